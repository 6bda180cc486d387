"""The executor's decode calls on a tiny engine: what a faster decode path (buffers bound once and refilled, tried
twice; docs/performance.md) must keep: rows left out stay untouched, results outlive the next call."""

import numpy as np

from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine


def test_a_decode_call_leaves_the_rows_it_does_not_decode_alone(engine_factory):
    """Rows of an earlier call in the same batch bucket are not decoded again: by then their cache row may hold
    another request, whose cache a repeated old token would overwrite."""
    executor = LLMEngine(EngineArgs(engine_factory(), threads=1, max_batch=2)).executor
    executor.prefill(0, [5, 6, 7], 0)
    executor.prefill(1, [8, 9, 10], 0)
    executor.decode([0, 1], [11, 12], [3, 3])
    executor.cache.free_row(0)
    executor.prefill(0, [13, 14], 0)  # row 0 now holds a new request: 2 cached positions
    keys, values = executor.cache.keys[:, 0].copy(), executor.cache.values[:, 0].copy()
    executor.decode([1], [15], [4])  # the same bucket of 2 rows
    np.testing.assert_array_equal(executor.cache.keys[:, 0], keys)
    np.testing.assert_array_equal(executor.cache.values[:, 0], values)


def test_decode_calls_of_either_bucket_give_the_one_row_answer(engine_factory):
    """The same row decoded alone and beside another gets the same logits, call after call."""
    executor = LLMEngine(EngineArgs(engine_factory(), threads=1, max_batch=2)).executor
    executor.prefill(0, [5, 6, 7], 0)
    alone = [executor.decode([0], [token], [3]).logits[0] for token in (11, 12)]
    executor.prefill(1, [8, 9, 10], 0)
    for token, expected in zip((11, 12), alone):
        batched = executor.decode([0, 1], [token, 20], [3, 3])
        np.testing.assert_allclose(batched.logits[0], expected, rtol=1e-5, atol=1e-5)


def test_a_decode_result_is_not_overwritten_by_the_next_call(engine_factory):
    executor = LLMEngine(EngineArgs(engine_factory(), threads=1, max_batch=2)).executor
    executor.prefill(0, [5, 6, 7], 0)
    first = executor.decode([0], [11], [3])
    logits, hidden = first.logits.copy(), first.hidden.copy()
    executor.decode([0], [12], [3])
    np.testing.assert_array_equal(first.logits, logits)
    np.testing.assert_array_equal(first.hidden, hidden)


def test_greedy_calls_in_a_row_match_single_calls_and_leave_other_rows_alone(engine_factory):
    """Executor.decode_greedy feeds each argmax back as the next token, as one decode call at a time would, over a
    row that is not the bucket's first; it stops before a call that picks a stop token."""
    engines = [LLMEngine(EngineArgs(engine_factory(), threads=1, max_batch=2)) for _ in range(2)]
    for engine in engines:
        engine.executor.prefill(0, [5, 6, 7], 0)
        engine.executor.prefill(1, [8, 9, 10], 0)
    bursting, single = (engine.executor for engine in engines)
    keys = bursting.cache.keys[:, 0].copy()
    nothing_stops = np.zeros(engines[0].manifest.model.vocab_size, bool)
    tokens = bursting.decode_greedy([1], [12], [3], 6, nothing_stops)
    expected, token = [], 12
    for position in range(3, 9):
        token = int(single.decode([1], [token], [position]).argmax[0])
        expected.append(token)
    assert tokens.tolist() == [expected]
    np.testing.assert_array_equal(bursting.cache.keys[:, 0], keys)
    stops = nothing_stops.copy()
    stops[expected[0]] = True  # the first call picks it: no tokens (the stop inside a burst: test_llm_engine.py)
    calls = bursting.step_calls
    assert bursting.decode_greedy([1], [12], [3], 6, stops).shape == (1, 0) and bursting.step_calls == calls + 1


def test_a_call_spans_the_cache_rows_from_its_lowest_row_not_from_row_0(engine_factory):
    """A row left alone in cache row 3 (the rows below it finished) runs a one-row call over that row, not a
    4-row one: a call computes every row it spans, and a verify call every row's whole tree bucket. Its results are
    the ones it gets among the others."""
    executor = LLMEngine(EngineArgs(engine_factory(), threads=1, max_batch=4)).executor
    for row in range(4):
        executor.prefill(row, [5 + row, 6, 7], 0)
    calls = []
    run = executor._run
    executor._run = lambda phase, input_ids, *rest: (
        calls.append((rest[-1], input_ids.shape)),
        run(phase, input_ids, *rest),
    )[1]
    together = executor.decode([0, 1, 2, 3], [11, 12, 13, 14], [3, 3, 3, 3])
    tree = ([15, 16, 17], np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool))
    verified_together = executor.verify([0, 3], [tree, tree], [4, 4])
    expected = together.logits[3].copy(), verified_together.logits[1].copy()
    calls.clear()
    alone = executor.decode([3], [14], [3])
    verified_alone = executor.verify([3], [tree], [4])
    assert calls == [(3, (1, 1)), (3, (1, 3))]
    np.testing.assert_allclose(alone.logits[0], expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(verified_alone.logits[0], expected[1], rtol=1e-5, atol=1e-5)
    executor.decode([1, 3], [12, 14], [4, 4])  # from row 1: 3 rows
    executor.min_rows = 2  # where a lone row is padded to two, the pair ends at the cache's last row
    executor.decode([3], [14], [4])
    assert calls[2:] == [(1, (3, 1)), (2, (2, 1))]
