"""GGUF blocks taken as they are: Q4_0 / Q4_1 / Q8_0 map exactly onto the quantized linear, and a tiny GGUF's int4
engine computes exactly what its fp32 engine (the same GGUF dequantized) computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from builder.build import BuildOptions, build_engine
from builder.loaders import load_checkpoint
from builder.loaders.gguf_blocks import BlockQuantized
from builder.weights import auto_quantization, kept_block_specs
from plugins.quant_linear import QuantSpec, dequantize_blockwise
from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from runner.tools.bench import weight_bytes_per_step
from tests.builder.test_quantized_engine import TEXT, teacher_forced_logits
from tests.runner.tools.test_bench import initializer_bytes_read_per_step
from tests.tiny_checkpoint import make_gguf


@pytest.mark.parametrize("kind, bits", [("Q4_0", 4), ("Q4_1", 4), ("Q8_0", 8)])
def test_blocks_convert_exactly(kind, bits):
    """Against gguf-py's own dequantizer (llama.cpp's reference for the formats)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    weight = np.random.default_rng(0).standard_normal((12, 96)).astype(np.float32) + 0.3  # a mean: Q4_1's min matters
    raw = gguf.quants.quantize(weight, qtype)
    qweight, scales, minimums = BlockQuantized(kind, raw, 96).to_matmul_nbits()
    assert qweight.shape == (12, 3, 32 * bits // 8) and scales.shape == (36,)
    assert (minimums is not None) == (kind == "Q4_1")
    ours = dequantize_blockwise(qweight, scales, 96, bits, minimums)
    expected = gguf.quants.dequantize(raw, qtype).reshape(12, 96)
    np.testing.assert_allclose(ours.numpy(), expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    # the file's fp16 scale and minimum, bit for bit
    blocks = raw.reshape(12, 3, -1)
    assert np.array_equal(scales.numpy().astype(np.float16), blocks[..., 0:2].copy().view(np.float16).reshape(-1))
    if minimums is not None:
        assert minimums.dtype == torch.float16
        assert np.array_equal(minimums.numpy(), blocks[..., 2:4].copy().view(np.float16)[..., 0])


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
    assert kept["model.layers.0.self_attn.qkv_proj"] == QuantSpec(4, 32, minimums=True)
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
    fp32 = build(tiny_gguf, tmp_path / "fp32", quant="none")
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


def untiled(tiled: np.ndarray, n: int, bits: int | None = None) -> np.ndarray:
    """An initializer of our quantized matmul back in column order: tiles of 16 columns (padded), per 32 values of K
    (weights: `bits` vectors of 16 lanes x 4 bytes) or per block (scales, minimums) the tile's 16 columns."""
    padded = -(-n // 16) * 16
    if bits is None:
        return tiled.reshape(padded // 16, -1, 16).transpose(0, 2, 1).reshape(padded, -1)[:n]
    lanes = tiled.reshape(padded // 16, -1, bits, 16, 4)  # tiles, chunks, vectors, columns, bytes
    return lanes.transpose(0, 3, 1, 2, 4).reshape(padded, -1)[:n]


def test_auto_builds_a_gguf_at_its_own_blocks_in_our_fused_kernels(tiny_gguf, tmp_path):
    """The default (--quant auto) keeps the file's Q4_1 / Q8_0 blocks: each linear one Int4MatMul (minimums inside)
    or Int8MatMul node holding the file's codes, float16 scales and minimums bit for bit; no MatMulNBits, no
    block-sum offset matmul, no split-out activation left in the graph; the embedding read from the head's blocks."""
    import gguf
    import onnx
    from onnx import numpy_helper

    engine = build(tiny_gguf, tmp_path / "auto")
    facts = engine.manifest.quantization
    assert (facts.method, facts.bits, facts.group_size) == ("gguf-blocks", 4, 32)
    assert facts.source_blocks_kept == {"Q4_1": 14, "Q8_0": 1} and facts.linears_requantized == 0
    step = engine.manifest.graphs["step"]
    model = onnx.load(str(engine.artifact.path(step.file)))
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("Int4MatMul") == 2 * 4 and ops.count("Int8MatMul") == 1  # qkv, o, gate_up, down; LM head
    assert not {"MatMulNBits", "ReduceSum", "Split", "Sigmoid"} & set(ops)
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (o_proj,) = [n for n in model.graph.node if n.op_type == "Int4MatMul" and "layers.1.self_attn.o_proj" in n.input[1]]
    assert len(o_proj.input) == 4
    raw = next(t for t in gguf.GGUFReader(str(tiny_gguf)).tensors if t.name == "blk.1.attn_output.weight")
    n = next(a.i for a in o_proj.attribute if a.name == "N")
    blocks = np.asarray(raw.data).reshape(n, -1, 20)
    scales, minimums = (untiled(constants[name], n) for name in o_proj.input[2:])
    assert scales.dtype == minimums.dtype == np.float16
    assert np.array_equal(scales.reshape(-1), blocks[..., 0:2].copy().view(np.float16).reshape(-1))
    assert np.array_equal(minimums.reshape(blocks.shape[:2]), blocks[..., 2:4].copy().view(np.float16)[..., 0])
    nibbles = untiled(constants[o_proj.input[1]], n, bits=4)
    values = np.stack([nibbles & 15, nibbles >> 4], axis=-1).reshape(*blocks.shape[:2], 32)
    assert np.array_equal(values, np.concatenate((blocks[..., 4:] & 15, blocks[..., 4:] >> 4), axis=-1))
    # the tied LM head's Q8_0 blocks are the embedding table too: read by a Gather, no float copy of the table
    (head,) = [n for n in model.graph.node if n.op_type == "Int8MatMul"]
    assert any(n.op_type == "Gather" and n.input[0] == head.input[1] for n in model.graph.node)
    table = [engine.manifest.model.vocab_size, engine.manifest.model.hidden_size]
    assert not [t.name for t in model.graph.initializer if list(t.dims) == table]
    # ... so a decode step reads all of the head's blocks, which runner bench's MBU counts
    expected = initializer_bytes_read_per_step(tmp_path / "auto")
    assert expected * 0.98 <= weight_bytes_per_step(engine) <= expected
    assert build(tiny_gguf, tmp_path / "float", quant="none").manifest.quantization.bits is None


def test_auto_quantization_follows_the_files_types(checkpoint_factory):
    config = load_checkpoint(checkpoint_factory("gqa")).config
    layers = [f"model.layers.{i}.{p}.weight" for i in range(2) for p in ("self_attn.q_proj", "mlp.down_proj")]
    assert auto_quantization(config, {}) == "none"  # a Hugging Face checkpoint
    assert auto_quantization(config, dict.fromkeys(layers, "F16")) == "none"
    assert auto_quantization(config, dict.fromkeys(layers, "Q8_0")) == "int8"
    assert auto_quantization(config, dict.fromkeys(layers, "Q6_K")) == "int8"
    assert auto_quantization(config, dict.fromkeys(layers, "Q4_1") | {layers[0]: "Q6_K"}) == "int4"
    assert auto_quantization(config, dict.fromkeys(layers, "Q4_K")) == "int4"


def test_auto_requantizes_other_gguf_types_and_says_from_which(checkpoint_factory, tmp_path):
    """A Q5_0 file (no exact form here): auto builds int8 (more bits than 4, never fewer), the layers requantized from
    Q5_0 as the manifest and the build summary say, the Q8_0 head kept."""
    source = make_gguf(tmp_path / "q5.gguf", checkpoint_factory("gqa"), linear_type="Q5_0")
    lines = []
    build_engine(BuildOptions(str(source), tmp_path / "e", max_seq_len=128, max_batch=2), log=lines.append)
    facts = LLMEngine(EngineArgs(tmp_path / "e")).manifest.quantization
    assert (facts.bits, facts.method, facts.linears_kept) == (8, "gguf-blocks+rtn", 1)
    assert facts.requantized_from == {"Q5_0": 14} and facts.embedding_from_head
    assert any("8 quantized again from the file's Q5_0=14 weights" in line for line in lines), lines


def test_an_untied_ggufs_embedding_table_keeps_the_files_blocks(checkpoint_factory, tmp_path):
    """Untied, the table is stored apart from the head: the file's Q8_0 blocks as they are (the codes and float16
    scales a Gather reads, bit for bit; the engine then computes what the fp32 engine of the same file computes),
    or, for a type without an exact form (Q5_0), int4 blocks rounded from it, as the manifest and the log say."""
    import gguf
    import onnx
    from onnx import numpy_helper

    source = make_gguf(tmp_path / "untied.gguf", checkpoint_factory("mqa"))
    fp32 = build(source, tmp_path / "fp32", quant="none")
    lines = []
    build_engine(
        BuildOptions(str(source), tmp_path / "auto", max_seq_len=128, max_batch=2, int8_compute=False),
        log=lines.append,
    )
    engine = LLMEngine(EngineArgs(tmp_path / "auto"))
    facts = engine.manifest.quantization
    assert not facts.embedding_from_head and facts.source_blocks_kept == {"Q4_1": 14, "Q8_0": 1}
    table = facts.embedding
    assert (table.bits, table.group_size, table.minimums, table.source_blocks, table.rounded_from) == (
        8,
        32,
        False,
        "Q8_0",
        None,
    )
    vocab, hidden = engine.manifest.model.vocab_size, engine.manifest.model.hidden_size
    assert table.bytes == vocab * hidden + 4 * vocab * hidden // 32
    assert any("embedding table: int8 blocks of 32, the file's Q8_0 blocks" in line for line in lines), lines
    model = onnx.load(str(engine.artifact.path(engine.manifest.graphs["step"].file)))
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert not [name for name, value in constants.items() if value.dtype == np.float32 and value.size >= vocab * hidden]
    # what the lookups of the step's tokens read: the table's codes and scales (stored flat or by row)
    reshaped = {node.output[0]: node.input[0] for node in model.graph.node if node.op_type == "Reshape"}
    read = [
        constants[reshaped.get(node.input[0], node.input[0])]
        for node in model.graph.node
        if node.op_type == "Gather" and node.input[1] == "input_ids"
    ]
    (codes,), (scales,) = ([value for value in read if value.dtype == kind] for kind in (np.uint8, np.float32))
    raw = next(t for t in gguf.GGUFReader(str(source)).tensors if t.name == "token_embd.weight")
    blocks = np.asarray(raw.data).reshape(vocab, -1, 34)
    assert codes.dtype == np.uint8 and scales.dtype == np.float32
    assert np.array_equal((codes.astype(np.int16) - 128).reshape(-1), blocks[..., 2:].view(np.int8).reshape(-1))
    assert np.array_equal(scales.reshape(-1), blocks[..., 0:2].copy().view(np.float16).reshape(-1).astype(np.float32))

    prompt = fp32.codec.encode(TEXT)
    forced = prompt[1:] + prompt[:5]
    reference = teacher_forced_logits(fp32, prompt, forced)
    np.testing.assert_allclose(
        teacher_forced_logits(engine, prompt, forced), reference, rtol=0, atol=1e-4 * np.abs(reference).max()
    )

    q5 = make_gguf(tmp_path / "q5.gguf", checkpoint_factory("mqa"), embedding_type="Q5_0")
    table = build(q5, tmp_path / "q5", quant="int4").manifest.quantization.embedding
    assert (table.bits, table.minimums, table.source_blocks, table.rounded_from) == (4, False, None, "Q5_0")
