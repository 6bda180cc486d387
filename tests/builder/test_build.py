"""Build options: defaults that depend on other options; the draft graph's kernels."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.build import BuildOptions


@pytest.mark.parametrize(
    "method, drafts, nodes", [("redrafter", 2, 1 + 2 * 2 + 4), ("prompt-lookup", 4, 5), ("draft-model", 4, 5)]
)
def test_draft_length_defaults_per_speculation_method(method, drafts, nodes):
    options = BuildOptions("default", Path("out"), speculative=method)
    assert options.draft_len == drafts
    assert options.tree_nodes == nodes


@pytest.mark.parametrize("method, quant", [("redrafter", "int4"), ("draft-model", "int8")])
def test_draft_quantization_defaults_per_speculation_method(method, quant):
    assert BuildOptions("default", Path("out"), speculative=method).draft_quant == quant
    assert BuildOptions("default", Path("out"), speculative=method, draft_quant="none").draft_quant == "none"


def test_an_explicit_draft_length_is_kept():
    assert BuildOptions("default", Path("out"), speculative="draft-model", draft_len=6).draft_len == 6
    assert BuildOptions("default", Path("out"), speculative="redrafter", draft_len=1).tree_nodes == 1 + 2 * 1 + 4


@pytest.mark.parametrize("draft_quant, op", [("int4", "Int4MatMul"), ("int8", "Int8MatMul")])
def test_the_draft_graphs_linears_run_our_kernel_and_draft_as_onnxruntimes_would(
    engine_factory, tiny_draft_head, draft_quant, op
):
    import numpy as np
    import onnx

    from runner.llm import LLM

    options = dict(prefill_chunk=8, draft_head=tiny_draft_head[0], beam_width=3, draft_len=4, draft_quant=draft_quant)
    ours = engine_factory("gqa", **options)
    kept = engine_factory("gqa", **options, native_quantized_matmul=False)
    ops = {
        engine: {node.op_type for node in onnx.load(str(engine / "draft.onnx"), load_external_data=False).graph.node}
        for engine in (ours, kept)
    }
    assert op in ops[ours] and "MatMulNBits" not in ops[ours]
    assert "MatMulNBits" in ops[kept] and op not in ops[kept]

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((3, 64)).astype(np.float32)
    last_tokens = [5, 17, 90]
    (beams, scores), (kept_beams, kept_scores) = (
        LLM(engine).engine.executor.draft(hidden, last_tokens) for engine in (ours, kept)
    )
    np.testing.assert_array_equal(beams, kept_beams)
    np.testing.assert_allclose(scores, kept_scores, atol=1e-4)
