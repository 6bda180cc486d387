"""Per-operator decode profiles: the trace reader on a hand-written trace, and a profiled tiny engine."""

from __future__ import annotations

import json

import pytest

from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from runner.tools.profile import SKIPPED_DECODE_RUNS, profile_decode, read_trace


def test_read_trace_aggregates_the_kernels_of_the_kept_runs(tmp_path):
    def run(ts, dur):
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}

    def node(ts, op, dur):
        return {"cat": "Node", "name": f"n{ts}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}

    events = [
        run(0, 900),
        node(10, "MatMul", 800),  # skipped: a prefill run
        run(1000, 100),
        node(1010, "MatMul", 40),
        node(1060, "Add", 10),
        node(1070, "Add", 20),
        run(2000, 120),
        node(2010, "MatMul", 60),
        node(2080, "Add", 20),
        {"cat": "Node", "name": "n2090_fence_before", "ts": 2090, "dur": 5, "args": {"op_name": "Add"}},
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(events))
    profile = read_trace(trace, skip_runs=1)
    assert profile.runs == 2 and profile.run_ms == pytest.approx(0.110) and profile.kernel_ms == pytest.approx(0.075)
    assert [(o.op, o.nodes_per_run) for o in profile.ops] == [("MatMul", 1.0), ("Add", 1.5)]
    assert profile.ops[0].ms_per_run == pytest.approx(0.050) and profile.ops[1].ms_per_run == pytest.approx(0.025)
    assert "(executor, between kernels)" in "\n".join(profile.lines())
    with pytest.raises(ValueError, match="none after the first 3"):
        read_trace(trace, skip_runs=3)


@pytest.mark.parametrize("native", [False, True], ids=["onnxruntime attention", "our decode attention"])
def test_profile_decode_of_a_tiny_engine(engine_factory, native):
    from plugins.native_ops import unavailable_reason

    if native and unavailable_reason():
        pytest.skip(f"our kernels cannot be built here: {unavailable_reason()}")
    engine_dir = engine_factory("gqa", native_decode_attention=native)
    ids = LLMEngine(EngineArgs(engine_dir)).codec.encode("hello there")
    profile = profile_decode(engine_dir, ids, new_tokens=12, threads=1)
    assert profile.runs == 12 - 1 - SKIPPED_DECODE_RUNS  # decode runs only: the prefill and the first few are left out
    ops = {o.op: o for o in profile.ops}
    assert ops["DecodeAttention" if native else "GroupQueryAttention"].nodes_per_run == 2  # one per layer
    assert 0 < profile.kernel_ms < profile.run_ms
