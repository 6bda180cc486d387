"""loop_overhead on a tiny engine: the bare loop must decode the engine's greedy tokens, or its speed means nothing."""

import numpy as np
import pytest

from benchmarks.loop_overhead import BareDecodeLoop, GraphCallClock, MatmulsAlone, bare_run, engine_run, loop_overhead
from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine


def test_the_bare_loop_decodes_what_the_engine_decodes(engine_factory):
    engine = LLMEngine(EngineArgs(engine_factory(), threads=1, max_batch=1))
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
    assert [len(result[name]["runs"]) for name in ("engine", "bare", "matmuls")] == [2, 2, 2]
    assert result["lowest"] <= result["bare_over_engine"] <= result["highest"]
    assert 0 < result["matmuls_share_of_bare"] and 0 < result["matmuls_share_of_engine"]


@pytest.mark.parametrize("quant, op", [("none", "MatMul"), ("int4", "Int4MatMul"), ("int4", "MatMulNBits")])
def test_the_matmuls_alone_are_every_weight_matmul_of_the_decode_graph(engine_factory, tmp_path, quant, op):
    import onnx

    from plugins.native_ops import unavailable_reason

    if op == "Int4MatMul" and unavailable_reason():
        pytest.skip(f"our kernels cannot be built here: {unavailable_reason()}")
    engine = LLMEngine(
        EngineArgs(engine_factory(quant=quant, native_quantized_matmul=op == "Int4MatMul"), threads=1, max_batch=1)
    )
    graph = onnx.load(str(engine.artifact.path(engine.manifest.graphs[engine.executor.decode_phase.graph].file)))
    matmuls = MatmulsAlone(engine, tmp_path, threads=1)
    alone = onnx.load(str(tmp_path / "matmuls_alone.onnx"))
    expected = sum(n.op_type == op for n in graph.graph.node)
    assert matmuls.matmuls == expected == sum(n.op_type == op for n in alone.graph.node) > 0
    config = engine.manifest.model
    assert matmuls.arrays[f"y{expected}"].shape == (1, config.vocab_size)  # the LM head is the last, whole
    run = matmuls.run(4)
    assert run.decode_tok_s > 0 and not np.isnan(matmuls.arrays[f"y{expected}"]).any()
