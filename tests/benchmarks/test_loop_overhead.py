"""loop_overhead on a tiny engine: the bare loop must decode the engine's greedy tokens, or its speed means nothing."""

from benchmarks.loop_overhead import BareDecodeLoop, GraphCallClock, bare_run, engine_run, loop_overhead
from runner.llm_engine import LLMEngine


def test_the_bare_loop_decodes_what_the_engine_decodes(engine_factory):
    engine = LLMEngine(engine_factory(), threads=1, max_batch=1)
    loop = BareDecodeLoop(engine)
    clock = GraphCallClock(loop.session)
    ids = [5, 6, 7, 8]
    ours = engine_run(engine, clock, ids, 12)
    bare = bare_run(engine, loop, clock, ids, 12)
    assert bare.tokens == ours.tokens and len(ours.tokens) == 12
    assert ours.gap_us > 0 and bare.gap_us > 0
    assert not engine.scheduler.has_work  # the bare run's request is gone, its row free again


def test_loop_overhead_reports_both_loops_round_by_round(engine_factory):
    result = loop_overhead(engine_factory(), [5, 6, 7, 8], rounds=2, new_tokens=8, threads=1)
    assert [len(result[name]["runs"]) for name in ("engine", "bare")] == [2, 2]
    assert result["lowest"] <= result["bare_over_engine"] <= result["highest"]
