"""GGUF blocks taken as they are: Q4_0 / Q4_1 / Q8_0 map exactly onto the quantized linear, and a tiny GGUF's int4
engine computes exactly what its fp32 engine (the same GGUF dequantized) computes."""

from __future__ import annotations

import numpy as np
import pytest

from builder.build import BuildOptions, build_engine
from builder.loaders import load_checkpoint
from builder.loaders.gguf_blocks import BlockQuantized
from builder.weights import kept_block_specs
from plugins.quant_linear import QuantSpec, dequantize_blockwise
from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from tests.builder.test_quantized_engine import TEXT, teacher_forced_logits
from tests.tiny_checkpoint import make_gguf


@pytest.mark.parametrize("kind, bits", [("Q4_0", 4), ("Q4_1", 4), ("Q8_0", 8)])
def test_blocks_convert_exactly(kind, bits):
    """Against gguf-py's own dequantizer (llama.cpp's reference for the formats)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    weight = np.random.default_rng(0).standard_normal((12, 96)).astype(np.float32) + 0.3  # a mean: Q4_1's min matters
    raw = gguf.quants.quantize(weight, qtype)
    qweight, scales, offsets = BlockQuantized(kind, raw, 96).to_matmul_nbits()
    assert qweight.shape == (12, 3, 32 * bits // 8) and scales.shape == (36,)
    assert (offsets is not None) == (kind == "Q4_1")
    ours = dequantize_blockwise(qweight, scales, 96, bits)
    if offsets is not None:
        ours = ours + offsets.repeat_interleave(32, dim=1)
    expected = gguf.quants.dequantize(raw, qtype).reshape(12, 96)
    np.testing.assert_allclose(ours.numpy(), expected, rtol=0, atol=1e-6 * np.abs(expected).max())


def test_which_linears_keep_their_blocks(checkpoint_factory, tmp_path):
    config = load_checkpoint(checkpoint_factory("gqa")).config
    q4_1 = {
        f"model.layers.{i}.{p}.weight": "Q4_1"
        for i in range(2)
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    formats = q4_1 | {"model.embed_tokens.weight": "Q8_0"}
    kept = kept_block_specs(config, QuantSpec(4, 32), True, formats)
    assert len(kept) == 9 and kept["lm_head"] == QuantSpec(8, 32)  # a Q8_0 head keeps its 8 bits
    assert kept["model.layers.0.self_attn.qkv_proj"] == QuantSpec(4, 32, offsets=True)
    assert "lm_head" not in kept_block_specs(config, QuantSpec(4, 32), False, formats)
    assert kept_block_specs(config, QuantSpec(4, 64), True, formats) == {}  # other group size: requantize
    assert kept_block_specs(config, QuantSpec(8, 32), True, formats) == {"lm_head": QuantSpec(8, 32)}  # 4 < 8 bits
    mixed = formats | {"model.layers.1.self_attn.v_proj.weight": "Q8_0"}
    assert "model.layers.1.self_attn.qkv_proj" not in kept_block_specs(config, QuantSpec(4, 32), True, mixed)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, checkpoint_factory):
    return make_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", checkpoint_factory("gqa"))


def build(source, out, **options) -> LLMEngine:
    build_engine(
        BuildOptions(str(source), out, max_seq_len=128, max_batch=2, prefill_chunk=32, **options), log=lambda _: None
    )
    return LLMEngine(EngineArgs(out))


def test_int4_engine_of_a_q4_1_gguf_is_that_gguf(tiny_gguf, tmp_path):
    fp32 = build(tiny_gguf, tmp_path / "fp32")
    kept = build(tiny_gguf, tmp_path / "int4", quant="int4", int8_compute=False)
    facts = kept.manifest.quantization
    assert facts.source_blocks_kept == {"Q4_1": 14, "Q8_0": 1} and facts.method == "gguf-blocks"
    assert (facts.linears_kept, facts.linears_requantized, facts.block_offsets) == (9, 0, True)
    prompt = fp32.codec.encode(TEXT)
    forced = prompt[1:] + prompt[:5]
    reference = teacher_forced_logits(fp32, prompt, forced)
    np.testing.assert_allclose(
        teacher_forced_logits(kept, prompt, forced), reference, rtol=0, atol=1e-4 * np.abs(reference).max()
    )
    requantized = build(tiny_gguf, tmp_path / "rtn", quant="int4", int8_compute=False, keep_source_blocks=False)
    assert requantized.manifest.quantization.linears_kept == 0
    assert np.abs(teacher_forced_logits(requantized, prompt, forced) - reference).max() > 1e-2 * np.abs(reference).max()
