"""Prefix caching: which row's prefix a new request reuses, and, on a tiny engine, that a request started from
reused K/V (its own row's, or copied from another row, running or finished) answers as a fresh prefill does."""

from __future__ import annotations

import numpy as np
import pytest

from runner import LLM, SamplingParams
from runner.core.prefix_cache import PrefixCopy, PrefixIndex
from runner.core.request import Request, request_output
from runner.core.tokenizer import IncrementalDetokenizer

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def request(prompt: list[int], row: int, output: list[int] = (), computed: int = 0, salt: str | None = None) -> Request:
    made = Request(
        "r",
        None,
        list(prompt),
        SamplingParams(),
        IncrementalDetokenizer(None),
        np.random.default_rng(0),
        output_token_ids=list(output),
        row=row,
        cache_salt=salt,
    )
    made.num_computed = computed
    return made


def test_a_new_request_reuses_the_longest_held_prefix_and_recomputes_at_least_its_last_token():
    index = PrefixIndex()
    index.hold(request([1, 2, 3], row=2, output=[4, 5], computed=4))  # holds 1 2 3 4 (5 was never fed)
    index.hold(request([1, 2, 9], row=3, computed=3))
    new = request([1, 2, 3, 4, 5, 6], row=0)
    assert index.admit(new, running=[]) == PrefixCopy(source_row=2, target_row=0, length=4)
    assert new.num_computed == new.num_cached_tokens == 4
    same = request([1, 2, 3, 4], row=1)  # the whole prompt is held: its last token is computed again
    assert index.admit(same, running=[]) == PrefixCopy(2, 1, 3)
    assert same.num_computed == 3


def test_only_requests_with_the_same_cache_salt_share_cached_tokens():
    index = PrefixIndex()
    index.hold(request([1, 2, 3, 4], row=2, computed=4, salt="tenant a"))
    running = [request([1, 2, 3, 9], row=3, computed=4, salt="tenant b")]
    for salt, source, length in ((None, 0, 0), ("tenant c", 0, 0), ("tenant a", 2, 4), ("tenant b", 3, 3)):
        new = request([1, 2, 3, 4, 5], row=0, salt=salt)
        copy = index.admit(new, running=running)
        assert new.num_cached_tokens == length and (
            copy is None if length == 0 else copy == PrefixCopy(source, 0, length)
        )


def test_a_row_reuses_its_own_prefix_without_a_copy_and_forgets_what_it_held():
    index = PrefixIndex()
    index.hold(request([7, 8, 9], row=0, computed=3))
    index.hold(request([7, 8, 5], row=1, computed=3))
    first = request([7, 8, 1], row=0)
    assert index.admit(first, running=[]) is None  # a tie with row 1, and row 0 holds it: no copy
    assert first.num_computed == 2
    second = request([7, 8, 9, 9], row=2)
    assert index.admit(second, running=[]) == PrefixCopy(1, 2, 2)  # row 0's 7 8 9 is gone, row 1 still has 7 8


def test_running_rows_lend_what_they_have_computed_so_far():
    index = PrefixIndex()
    running = request([5, 6, 7, 8], row=0, computed=2)  # still prefilling: only 5 6 are in its row
    new = request([5, 6, 7, 8, 1], row=1)
    assert index.admit(new, running=[running]) == PrefixCopy(0, 1, 2)
    assert index.admit(request([4], row=2), running=[running]) is None  # nothing in common


@pytest.fixture(scope="module")
def engines(engine_factory):
    path = engine_factory("gqa", max_batch=2)
    return LLM(path, enable_prefix_caching=True), LLM(path)


def assert_same_answers(got, expected):
    assert expected.num_cached_tokens == 0
    assert got.token_ids == expected.token_ids
    np.testing.assert_allclose([t.logprob for t in got.logprobs], [t.logprob for t in expected.logprobs], atol=1e-4)


def test_answers_from_reused_prefixes_equal_fresh_prefills(engines):
    cached, fresh = engines
    encode = cached.tokenizer.encode
    system = encode("You are a helpful assistant who answers briefly. " * 3)

    def alone(prompt):
        got = cached.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
        assert_same_answers(got, fresh.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0])
        return got

    first = system + encode("hello world")
    answer = alone(first)
    assert answer.num_cached_tokens == 0
    # the next turn: its row (0) holds the first prompt and all but the last answer token
    turn = first + answer.token_ids + encode(" and then?")
    assert alone(turn).num_cached_tokens == len(first) + len(answer.token_ids) - 1

    # a request that shares the system prompt with one running in row 0 takes row 1: the prefix is copied there
    engine = cached.engine
    running = engine.add_request(None, system + encode("a long one") * 4, GREEDY)
    while not running.output_token_ids:
        engine.step()
    assert running.num_cached_tokens == len(system)  # from row 0's earlier turn
    beside = engine.add_request(None, system + encode("the quick brown fox"), GREEDY)
    for _ in engine.run([running, beside]):
        pass
    assert beside.row == 1 and beside.num_cached_tokens == len(system)
    for request in (running, beside):
        assert_same_answers(
            request_output([request]),
            fresh.generate(prompt_token_ids=[request.prompt_token_ids], sampling_params=GREEDY)[0],
        )

    # both rows are free now; a follow-up to the row-1 answer takes row 0 and copies from row 1
    follow_up = beside.prompt_token_ids + beside.output_token_ids + encode(" why?")
    assert alone(follow_up).num_cached_tokens == len(follow_up) - len(encode(" why?")) - 1


def test_requests_sent_together_share_a_system_prompt_the_first_computes(engines):
    """Both are admitted in the same step, before anything is computed; prompts are computed one after another, so
    the second matches again when its turn comes and copies the system prompt from the first's row."""
    cached, fresh = engines
    encode = cached.tokenizer.encode
    system = encode("Answer in the voice of a ship's captain, and keep every answer short. " * 3)
    prompts = [system + encode("hello world"), system + encode("the quick brown fox")]
    got = cached.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert (
        got[0].num_cached_tokens == 0
        and got[1].num_cached_tokens >= len(system) > cached.engine.scheduler.prefill_chunk
    )
    for output, prompt in zip(got, prompts):
        assert_same_answers(output, fresh.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0])


def test_finished_rows_keep_their_pages_for_later_requests(engines):
    cached, fresh = engines
    prompt = cached.tokenizer.encode("hello world " * 10)
    cached.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)
    assert cached.engine.executor.cache.resident_bytes() > 0
    assert cached.engine.scheduler.prefix_index is not None
    follow_up = prompt + cached.tokenizer.encode(" and more")
    got = cached.generate(prompt_token_ids=[follow_up], sampling_params=GREEDY)[0]
    assert got.num_cached_tokens >= len(prompt) - 1  # served from the finished row's pages
    assert_same_answers(got, fresh.generate(prompt_token_ids=[follow_up], sampling_params=GREEDY)[0])


def test_speculative_engines_reuse_prefixes_and_still_answer_as_plain_decoding(
    engine_factory, tiny_draft_head, engines
):
    """A verify step leaves rejected nodes' K/V past a row's computed positions: only computed ones are reused.
    (The engines are the ones tests/runner/speculative/test_speculative.py builds.)"""
    _, plain = engines
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    encode = plain.tokenizer.encode
    for options in (
        dict(draft_head=tiny_draft_head[0], beam_width=3, draft_len=4),
        dict(draft_model="mqa", draft_len=3),
    ):
        spec = LLM(
            engine_factory("gqa", prefill_chunk=8, **options), enable_prefix_caching=True, speculative_max_rows=None
        )
        prompt = encode("hello world, the quick brown fox")
        for turn in range(3):
            got = spec.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
            assert got.token_ids == plain.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
            # at most the earlier turn's context but its last token; less when that turn ended inside a verify step
            # (the accepted nodes of a request's last step are not moved into place: it is over)
            assert (got.num_cached_tokens == 0) == (turn == 0)
            assert got.num_cached_tokens <= len(prompt) - len(encode(" more")) - 1
            prompt = prompt + got.token_ids + encode(" more")
        assert spec.engine.speculation_stats.verify_steps > 0
