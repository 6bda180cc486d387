"""GGUF blocks taken as they are: Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 map exactly onto the
quantized linear, and a tiny GGUF's engine computes exactly what its fp32 engine (the same GGUF dequantized)
computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from builder.build import BuildOptions, build_engine
from builder.loaders import load_checkpoint
from builder.loaders.gguf_blocks import BlockQuantized
from builder.weights import (
    auto_quantization,
    embedding_spec,
    kept_block_specs,
    linear_sources,
    split_linears,
    wider_specs,
)
from plugins.int4_matmul import five_bit_bytes
from plugins.quant_linear import QuantSpec, dequantize_blockwise
from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from runner.tools.bench import weight_bytes_per_step
from tests.builder.test_quantized_engine import TEXT, teacher_forced_logits
from tests.runner.tools.test_bench import initializer_bytes_read_per_step
from tests.tiny_checkpoint import make_gguf


@pytest.mark.parametrize("kind, bits", [("Q4_0", 4), ("Q4_1", 4), ("Q5_0", 8), ("Q5_1", 8), ("Q8_0", 8)])
def test_blocks_convert_exactly(kind, bits):
    """Against gguf-py's own dequantizer (llama.cpp's reference for the formats)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    weight = np.random.default_rng(0).standard_normal((12, 96)).astype(np.float32) + 0.3  # a mean: Q4_1's min matters
    raw = gguf.quants.quantize(weight, qtype)
    qweight, scales, minimums = BlockQuantized(kind, raw, 96).to_matmul_nbits()
    assert qweight.shape == (12, 3, 32 * bits // 8) and scales.shape == (36,)
    assert (minimums is not None) == (kind in ("Q4_1", "Q5_1"))
    assert qweight.dtype == torch.uint8 and (kind != "Q5_0" or set(qweight.unique().tolist()) <= set(range(112, 144)))
    assert kind != "Q5_1" or int(qweight.max()) <= 31  # as they are: w = d x q + m
    ours = dequantize_blockwise(qweight, scales, 96, bits, minimums)
    expected = gguf.quants.dequantize(raw, qtype).reshape(12, 96)
    np.testing.assert_allclose(ours.numpy(), expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    # the file's fp16 scale and minimum, bit for bit
    blocks = raw.reshape(12, 3, -1)
    assert np.array_equal(scales.numpy().astype(np.float16), blocks[..., 0:2].copy().view(np.float16).reshape(-1))
    if minimums is not None:
        assert minimums.dtype == torch.float16
        assert np.array_equal(minimums.numpy(), blocks[..., 2:4].copy().view(np.float16)[..., 0])


def random_q4_k(rows: int, in_features: int, seed: int = 0, block_bytes: int = 144) -> np.ndarray:
    """Q4_K super-blocks (Q5_K's with `block_bytes` 176) of random bytes (gguf-py has no K-quant quantizer): any
    bytes are valid blocks once the two float16s are finite; d and dmin small and positive as a quantizer writes
    them."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, in_features // 256, block_bytes), dtype=np.uint8)
    blocks[..., 0:4] = (rng.random((rows, in_features // 256, 2)) * [2e-3, 1e-2]).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind, bits, block_bytes", [("Q4_K", 4, 144), ("Q5_K", 8, 176)])
def test_k_quant_blocks_with_minimums_convert_exactly(kind, bits, block_bytes):
    """Each 32-input sub-block: its values (Q5_K's 5 bits as int8 blocks, as they are), scale d x sc and minimum
    -(dmin x m) in float32, computed as llama.cpp computes them, so the dequantized weight is gguf-py's bit for
    bit."""
    import gguf

    raw = random_q4_k(6, 512, block_bytes=block_bytes)
    qweight, scales, minimums = BlockQuantized(kind, raw, 512).to_matmul_nbits()
    assert qweight.shape == (6, 16, 32 * bits // 8) and scales.shape == (96,) and minimums.shape == (6, 16)
    assert minimums.dtype == scales.dtype == torch.float32
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(6, 512)
    np.testing.assert_array_equal(dequantize_blockwise(qweight, scales, 512, bits, minimums).numpy(), expected)
    assert bits == 4 or set(qweight.unique().tolist()) == set(range(32))
    assert not np.array_equal(scales.numpy().astype(np.float16).astype(np.float32), scales.numpy())  # not halves


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
    # Q5_0 is int8 exactly: beside a Q8_0 slice in one fused weight too
    q5_0 = mixed | {f"model.layers.1.self_attn.{p}_proj.weight": "Q5_0" for p in "qk"}
    assert kept_block_specs(config, QuantSpec(4, 32), True, q5_0)["model.layers.1.self_attn.qkv_proj"] == QuantSpec(
        8, 32
    )
    # Q4_K's sub-block scales and minimums are products of a float16 and a 6-bit integer: float32 minimums
    q4_k = formats | {"model.layers.0.mlp.gate_proj.weight": "Q4_K", "model.layers.0.mlp.up_proj.weight": "Q4_K"}
    kept = kept_block_specs(config, QuantSpec(4, 32), True, q4_k)
    assert kept["model.layers.0.mlp.gate_up_proj"] == QuantSpec(4, 32, minimums=True, minimum_dtype="float32")
    q4_k["model.layers.0.mlp.up_proj.weight"] = "Q4_1"  # float32 holds Q4_1's float16 minimums too
    kept = kept_block_specs(config, QuantSpec(4, 32), True, q4_k)
    assert kept["model.layers.0.mlp.gate_up_proj"] == QuantSpec(4, 32, minimums=True, minimum_dtype="float32")


def test_a_fused_linear_of_weights_stored_apart_runs_as_parts(checkpoint_factory):
    """A fused linear whose weights no one layout holds (Q4_K queries and keys beside Q6_K values, as llama.cpp's
    Q4_K_M writes some layers) is split into runs of weights stored alike, each part keeping its own blocks (or
    quantized on its own); weights one layout holds stay one linear."""
    config = load_checkpoint(checkpoint_factory("gqa")).config
    qkv, layer = "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn"
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    formats = {f"{layer}.q_proj.weight": "Q4_K", f"{layer}.k_proj.weight": "Q4_K", f"{layer}.v_proj.weight": "Q6_K"}
    int4 = QuantSpec(4, 32)
    splits = split_linears(config, int4, formats, formats)
    assert splits == {qkv: (0, q + kv, q + 2 * kv)}
    sources = linear_sources(config, False, splits)
    assert sources[f"{qkv}.parts.0"] == [f"{layer}.q_proj.weight", f"{layer}.k_proj.weight"]
    kept = kept_block_specs(config, int4, False, formats, splits=splits)
    assert qkv not in kept and kept[f"{qkv}.parts.0"] == QuantSpec(4, 32, minimums=True, minimum_dtype="float32")
    assert kept[f"{qkv}.parts.1"] == QuantSpec(8, 16)
    # q, k and v of three forms: three parts
    three = formats | {f"{layer}.k_proj.weight": "Q8_0"}
    assert split_linears(config, int4, three, three) == {qkv: (0, q, q + kv, q + 2 * kv)}
    # Q8_1 has no exact form: the values part is int8 from float, the rest keeps its blocks
    types = formats | {f"{layer}.v_proj.weight": "Q8_1"}
    formats.pop(f"{layer}.v_proj.weight")
    splits = split_linears(config, int4, formats, types)
    kept = kept_block_specs(config, int4, False, formats, splits=splits)
    assert wider_specs(config, int4, False, types, kept, splits) == {f"{qkv}.parts.1": QuantSpec(8, 32)}
    # one layout holds Q4_0 and Q4_1 (minimums of zero for Q4_0), and float weights quantize alike: no split
    alike = {f"{layer}.q_proj.weight": "Q4_0", f"{layer}.k_proj.weight": "Q4_1", f"{layer}.v_proj.weight": "Q4_0"}
    assert split_linears(config, int4, alike, alike) == {}
    assert split_linears(config, int4, {}, {}) == {} and split_linears(config, None, formats, types) == {}
    # Q5_0 beside Q8_0: int8 blocks hold both, but our kernels keep Q5_0 in 5 bits, so they split where those run
    q5_0 = {f"{layer}.q_proj.weight": "Q5_0", f"{layer}.k_proj.weight": "Q5_0", f"{layer}.v_proj.weight": "Q8_0"}
    assert split_linears(config, int4, q5_0, q5_0) == {}
    assert split_linears(config, int4, q5_0, q5_0, packed_forms=True) == {qkv: (0, q + kv, q + 2 * kv)}
    assert split_linears(config, QuantSpec(4, 32, accuracy_level=0), q5_0, q5_0, packed_forms=True) == {}
    # Q5_1 values beside Q5_0 or Q5_K queries and keys: one int8 layout with minimums, but 5-bit nodes of their own
    for kind in ("Q5_0", "Q5_K"):
        mixed = dict.fromkeys(q5_0, kind) | {f"{layer}.v_proj.weight": "Q5_1"}
        assert split_linears(config, int4, mixed, mixed) == {}
        assert split_linears(config, int4, mixed, mixed, packed_forms=True) == {qkv: (0, q + kv, q + 2 * kv)}


def test_a_weight_with_more_bits_than_the_build_is_quantized_to_int8(checkpoint_factory):
    """Q8_1 / Q8_K have no exact form (nor Q6_K where it is not kept): requantized, but never to fewer bits than the
    file gives them (a fused linear not split into parts goes int8 whole; a table alike)."""
    config = load_checkpoint(checkpoint_factory("gqa")).config
    down = "model.layers.1.mlp.down_proj"
    types = {f"{down}.weight": "Q6_K", "model.layers.0.self_attn.v_proj.weight": "Q8_1"}
    types |= {"model.layers.0.self_attn.q_proj.weight": "Q4_K", "model.layers.0.mlp.up_proj.weight": "Q4_K"}
    wider = wider_specs(config, QuantSpec(4, 32), True, types, {})
    assert wider == {down: QuantSpec(8, 32), "model.layers.0.self_attn.qkv_proj": QuantSpec(8, 32)}
    assert wider_specs(config, QuantSpec(4, 32), True, types, {down: QuantSpec(4, 32)}) == {
        "model.layers.0.self_attn.qkv_proj": QuantSpec(8, 32)
    }
    assert wider_specs(config, QuantSpec(8, 128), True, types, {}) == {}
    assert wider_specs(config, None, True, types, {}) == {}
    table = {"model.embed_tokens.weight": "Q8_1"}
    assert embedding_spec(QuantSpec(4, 32), False, True, table) == QuantSpec(8, 32)


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
    block-sum offset matmul, no split-out activation left in the graph; the embedding read from the head's blocks
    by one QuantizedRows node."""
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
    # the tied LM head's Q8_0 blocks are the embedding table too: read by our lookup node, no float copy of the table
    (head,) = [n for n in model.graph.node if n.op_type == "Int8MatMul"]
    (rows,) = [n for n in model.graph.node if n.op_type == "QuantizedRows"]
    assert rows.input[1:] == head.input[1:] and "Gather" not in ops
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
    """A Q5_1 file: auto builds int8 (more bits than 4, never fewer) and keeps its blocks, each linear's 5-bit values
    in an Int5MatMul node. Beside Q4_0 layers, IQ4_NL down projections (a type no engine layout holds) are
    requantized to the build's int4, as the manifest and the build summary say."""
    import onnx

    source = make_gguf(tmp_path / "q5.gguf", checkpoint_factory("gqa"), linear_type="Q5_1")
    engine = build(source, tmp_path / "e")
    facts = engine.manifest.quantization
    assert (facts.bits, facts.method, facts.linears_kept, facts.linears_requantized) == (8, "gguf-blocks", 9, 0)
    assert facts.source_blocks_kept == {"Q5_1": 14, "Q8_0": 1} and facts.embedding_from_head
    model = onnx.load(str(engine.artifact.path(engine.manifest.graphs["step"].file)), load_external_data=False)
    ops = [node.op_type for node in model.graph.node]
    assert (ops.count("Int5MatMul"), ops.count("Int8MatMul")) == (2 * 4, 1)  # the layers; the Q8_0 head

    mixed = make_gguf(
        tmp_path / "q4_0.gguf", checkpoint_factory("gqa"), linear_type="Q4_0", module_types={"mlp.down_proj": "IQ4_NL"}
    )
    lines = []
    build_engine(BuildOptions(str(mixed), tmp_path / "mixed", max_seq_len=128, max_batch=2), log=lines.append)
    facts = LLMEngine(EngineArgs(tmp_path / "mixed")).manifest.quantization
    assert (facts.bits, facts.linears_kept, facts.linears_requantized, facts.linears_widened) == (4, 7, 2, 0)
    assert facts.requantized_from == {"IQ4_NL": 2}
    assert any("2 quantized again from the file's IQ4_NL=2 weights" in line for line in lines), lines


def test_an_untied_ggufs_embedding_table_keeps_the_files_blocks(checkpoint_factory, tmp_path):
    """Untied, the table is stored apart from the head: the file's Q8_0 blocks as they are (the codes and float16
    scales a Gather reads, bit for bit; the engine then computes what the fp32 engine of the same file computes),
    (Q5_1's with their minimums too), or, for a type without an exact form (IQ4_NL), blocks rounded from it, as the
    manifest and the log say."""
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

    q5 = make_gguf(tmp_path / "q5.gguf", checkpoint_factory("mqa"), embedding_type="Q5_1")
    table = build(q5, tmp_path / "q5", quant="int4").manifest.quantization.embedding
    assert (table.bits, table.minimums, table.source_blocks, table.rounded_from) == (8, True, "Q5_1", None)
    iq4 = make_gguf(tmp_path / "iq4.gguf", checkpoint_factory("mqa"), embedding_type="IQ4_NL")
    table = build(iq4, tmp_path / "iq4", quant="int4").manifest.quantization.embedding
    assert (table.bits, table.minimums, table.source_blocks, table.rounded_from) == (4, False, None, "IQ4_NL")


def assert_computes_what(reference_engine: LLMEngine, engine: LLMEngine, tolerance: float = 1e-4) -> None:
    """The engine's logits after a prompt and forced tokens are the reference engine's (`tolerance` of the
    largest)."""
    prompt = reference_engine.codec.encode(TEXT)
    forced = prompt[1:] + prompt[:5]
    reference = teacher_forced_logits(reference_engine, prompt, forced)
    np.testing.assert_allclose(
        teacher_forced_logits(engine, prompt, forced), reference, rtol=0, atol=tolerance * np.abs(reference).max()
    )


def test_a_q4_k_gguf_engine_holds_the_files_sub_blocks(checkpoint_factory, tmp_path):
    """Q4_K layers go in as they are: computed in float, the engine equals the fp32 engine of the same file; with
    int8 activations each linear is one Int4MatMul node whose scales and minimums are the file's factors (float16 d
    and -dmin per 256 inputs, uint8 sc and m per 32), which multiply to the file's sub-block products d x sc and
    -(dmin x m), and whose nibbles are the file's (the kernel's numerics against float64, and against the products
    stored as float32: tests/plugins/test_int4_matmul.py)."""
    import onnx

    source = make_gguf(tmp_path / "q4_k.gguf", checkpoint_factory("k_quants"), linear_type="Q4_K")
    fp32 = build(source, tmp_path / "fp32", quant="none")
    exact = build(source, tmp_path / "exact", int8_compute=False)
    facts = exact.manifest.quantization
    assert (facts.bits, facts.method, facts.source_blocks_kept) == (4, "gguf-blocks", {"Q4_K": 14, "Q8_0": 1})
    assert_computes_what(fp32, exact)

    engine = build(source, tmp_path / "auto")
    model = onnx.load(str(engine.artifact.path(engine.manifest.graphs["step"].file)))
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("Int4MatMul") == 2 * 4 and not {"MatMulNBits", "ReduceSum"} & set(ops)
    stored, values = factored_o_proj(model, "Int4MatMul", source, "Q4_K")
    assert np.array_equal(untiled(stored, len(values), bits=4), values.reshape(len(values), -1))


def factored_o_proj(model, op: str, source, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Layer 1's o_proj node of `op` in `model`, built from `source`'s `kind` (Q4_K, Q5_K) blocks: asserts that its
    scales and minimums are the file's sub-block products d x sc and -(dmin x m) stored factored (uint8 multipliers,
    float16 factors); returns its stored weights (column tiles) and the file's values [N, K / 32, block bytes]."""
    import gguf
    from onnx import numpy_helper

    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (o_proj,) = [n for n in model.graph.node if n.op_type == op and "layers.1.self_attn.o_proj" in n.input[1]]
    n = next(a.i for a in o_proj.attribute if a.name == "N")
    raw = next(t for t in gguf.GGUFReader(str(source)).tensors if t.name == "blk.1.attn_output.weight")
    values, scales, minimums = BlockQuantized(kind, np.asarray(raw.data), 256).to_matmul_nbits()
    multipliers, minimum_multipliers, factors = (untiled(constants[name], n) for name in o_proj.input[2:])
    assert multipliers.dtype == minimum_multipliers.dtype == np.uint8 and factors.dtype == np.float16
    per_chunk = factors.reshape(n, -1, 1, 2).repeat(8, axis=2).reshape(n, -1, 2).astype(np.float32)
    assert np.array_equal(per_chunk[..., 0] * multipliers, scales.numpy().reshape(n, -1))
    assert np.array_equal(per_chunk[..., 1] * minimum_multipliers, minimums.numpy())
    return constants[o_proj.input[1]], values.numpy()


@pytest.mark.parametrize("kind, op", [("Q4_K", "Int4MatMul"), ("Q5_K", "Int5MatMul"), ("Q6_K", "Int6MatMul")])
def test_a_tied_k_quant_table_is_read_from_the_heads_own_form(checkpoint_factory, tmp_path, kind, op):
    """A K-quant token_embd with no output.weight: the LM head keeps the file's blocks, and the lookup reads them:
    computed in float, the engine is the fp32 engine of the file; with our kernels, one QuantizedRows node reads the
    head's node's own inputs (Q4_K and Q5_K factored, Q5_K in 5 bits, Q6_K in 6: the file's bytes a weight) and
    nothing else reads
    them (the rows against the reference, bit for bit, in tests/plugins/test_int4_matmul.py)."""
    import onnx

    source = make_gguf(tmp_path / "tied.gguf", checkpoint_factory("k_quants"), linear_type="Q4_K", embedding_type=kind)
    fp32 = build(source, tmp_path / "fp32", quant="none")
    exact = build(source, tmp_path / "exact", int8_compute=False)
    facts = exact.manifest.quantization
    kept = {"Q4_K": 15} if kind == "Q4_K" else {"Q4_K": 14, kind: 1}
    assert facts.source_blocks_kept == kept and facts.linears_requantized == 0 and facts.embedding_from_head
    assert_computes_what(fp32, exact)
    engine = build(source, tmp_path / "auto")
    assert engine.manifest.quantization.source_blocks_kept == facts.source_blocks_kept
    model = onnx.load(str(engine.artifact.path(engine.manifest.graphs["step"].file)), load_external_data=False)
    (head,) = [n for n in model.graph.node if n.op_type == op and "lm_head" in n.input[1]]
    (rows,) = [n for n in model.graph.node if n.op_type == "QuantizedRows"]
    assert list(rows.input[1:]) == list(head.input[1:]) and len(head.input) == (4 if kind == "Q6_K" else 5)
    readers = [n for n in model.graph.node if set(n.input) & set(head.input[1:])]
    assert readers == [rows, head] or readers == [head, rows]
    assert "QuantizedRows" in engine.manifest.graphs["step"].native_ops
    # the node alone, on the engine's stored inputs: every row of the table is the file's, bit for bit
    import gguf
    import onnxruntime as ort
    from onnx import TensorProto, helper

    stored = onnx.load(str(engine.artifact.path(engine.manifest.graphs["step"].file)))
    ids = rows.input[0]
    graph = helper.make_graph(
        [rows],
        "rows",
        [helper.make_tensor_value_info(ids, TensorProto.INT64, [1, "tokens"])],
        [helper.make_tensor_value_info(rows.output[0], TensorProto.FLOAT, None)],
        [t for t in stored.graph.initializer if t.name in rows.input[1:]],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(rows.domain, 1)]
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(engine.artifact.path(engine.manifest.graphs["step"].native_library)))
    session = ort.InferenceSession(
        helper.make_model(graph, opset_imports=opsets).SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    vocab = engine.manifest.model.vocab_size
    table = session.run(None, {ids: np.arange(vocab, dtype=np.int64)[None]})[0][0]
    raw = next(t for t in gguf.GGUFReader(str(source)).tensors if t.name == "token_embd.weight")
    expected = gguf.quants.dequantize(np.asarray(raw.data), raw.tensor_type).reshape(vocab, -1)
    np.testing.assert_array_equal(table, expected)


def test_q6_k_blocks_convert_exactly():
    """Each 16-input sub-block: its 6-bit values (q - 32 as int8's stored q + 128) and scale d x sc in float32, as
    llama.cpp computes them: the dequantized weight is gguf-py's bit for bit (random bytes: any are valid blocks
    once d is a finite float16)."""
    import gguf

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (6, 2, 210), dtype=np.uint8)
    blocks[..., 208:210] = (rng.random((6, 2, 1)) * 2e-3 - 1e-3).astype(np.float16).view(np.uint8)
    raw = blocks.reshape(6, -1)
    qweight, scales, minimums = BlockQuantized("Q6_K", raw, 512).to_matmul_nbits()
    assert qweight.shape == (6, 32, 16) and scales.shape == (192,) and minimums is None
    assert 96 <= qweight.min() and qweight.max() <= 96 + 63
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(6, 512)
    np.testing.assert_array_equal(dequantize_blockwise(qweight, scales, 512, 8).numpy(), expected)


def q6_k_engines(checkpoint_factory, tmp_path, q6_k_module: str) -> tuple:
    """A Q4_K GGUF whose `q6_k_module` projections are Q6_K, its fp32 engine and its engine of the file's blocks
    computed in float, checked to keep every block and compute what the fp32 engine does."""
    source = make_gguf(
        tmp_path / "k_quants.gguf",
        checkpoint_factory("k_quants"),
        linear_type="Q4_K",
        module_types={q6_k_module: "Q6_K"},
    )
    fp32 = build(source, tmp_path / "fp32", quant="none")
    exact = build(source, tmp_path / "exact", int8_compute=False)
    facts = exact.manifest.quantization
    assert facts.source_blocks_kept == {"Q4_K": 12, "Q6_K": 2, "Q8_0": 1} and facts.linears_requantized == 0
    assert_computes_what(fp32, exact)
    return source, fp32, exact


def test_q4_k_queries_and_keys_beside_q6_k_values_keep_their_blocks(checkpoint_factory, tmp_path):
    """The fused q/k/v of a layer whose values are Q6_K and queries and keys Q4_K (llama.cpp's Q4_K_M) runs as two
    nodes, each holding its weights' own blocks: computed in float, the engine is the file's fp32 engine; with int8
    activations the parts are our Int4MatMul and Int6MatMul, their outputs concatenated into the packed q | k | v."""
    import onnx

    source, fp32, exact = q6_k_engines(checkpoint_factory, tmp_path, "self_attn.v_proj")
    facts = exact.manifest.quantization
    assert (facts.linears_kept, facts.linears_widened) == (11, 0)

    engine = build(source, tmp_path / "auto")
    model = onnx.load(str(engine.artifact.path(engine.manifest.graphs["step"].file)), load_external_data=False)
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("Int6MatMul") == 2 and "MatMulNBits" not in ops
    values = [n for n in model.graph.node if n.op_type == "Int6MatMul"]
    assert all("self_attn.qkv_proj.parts.1" in n.input[1] for n in values)
    for node in values:
        (concat,) = [n for n in model.graph.node if node.output[0] in n.input]
        assert concat.op_type == "Concat"
    prompt = fp32.codec.encode(TEXT)
    reference = teacher_forced_logits(exact, prompt, prompt[1:4])
    logits = teacher_forced_logits(engine, prompt, prompt[1:4])
    assert np.abs(logits - reference).max() < 0.15 * np.abs(reference).max()


def test_q5_0_layers_run_in_five_bits_beside_q8_0_values(checkpoint_factory, tmp_path):
    """llama.cpp's K-quant mixes fall back to Q5_0 (and Q8_0 for the values) where a row is not a multiple of 256,
    as in the default model's Q4_K_M: computed in float, the engine is the file's fp32 engine; with int8
    activations every Q5_0 linear is one Int5MatMul node holding the file's values in 5 bits and its float16 scales
    (5.5 bits a weight, as the file), the fused q/k/v split where its values are Q8_0."""
    import gguf
    import onnx
    from onnx import numpy_helper

    source = make_gguf(
        tmp_path / "q5_0.gguf", checkpoint_factory("gqa"), linear_type="Q5_0", module_types={"self_attn.v_proj": "Q8_0"}
    )
    fp32 = build(source, tmp_path / "fp32", quant="none")
    exact = build(source, tmp_path / "exact", int8_compute=False)
    assert exact.manifest.quantization.source_blocks_kept == {"Q5_0": 12, "Q8_0": 3}
    assert_computes_what(fp32, exact)

    engine = build(source, tmp_path / "auto")
    facts = engine.manifest.quantization
    assert (facts.linears_kept, facts.linears_requantized, facts.linears_widened) == (11, 0, 0)
    model = onnx.load(str(engine.artifact.path(engine.manifest.graphs["step"].file)))
    five = [n for n in model.graph.node if n.op_type == "Int5MatMul"]
    assert len(five) == 2 * 4 and "MatMulNBits" not in [node.op_type for node in model.graph.node]
    assert "Int5MatMul" in engine.manifest.graphs["step"].native_ops
    values = [n for n in model.graph.node if n.op_type == "Int8MatMul" and "qkv_proj.parts.1" in n.input[1]]
    assert len(values) == 2
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (o_proj,) = [n for n in five if "layers.1.self_attn.o_proj" in n.input[1]]
    n = next(a.i for a in o_proj.attribute if a.name == "N")
    raw = next(t for t in gguf.GGUFReader(str(source)).tensors if t.name == "blk.1.attn_output.weight")
    hidden = engine.manifest.model.hidden_size
    stored, scales, _ = BlockQuantized("Q5_0", np.asarray(raw.data), hidden).to_matmul_nbits()
    assert np.array_equal(untiled(constants[o_proj.input[2]], n), scales.numpy().reshape(n, -1).astype(np.float16))
    codes = untiled(constants[o_proj.input[1]], n, bits=5).reshape(n, -1, 20)
    expected = five_bit_bytes(stored.numpy().reshape(n, -1) - np.uint8(112)).reshape(n, -1, 20)
    assert np.array_equal(codes, expected)
    prompt = fp32.codec.encode(TEXT)
    reference = teacher_forced_logits(exact, prompt, prompt[1:4])
    logits = teacher_forced_logits(engine, prompt, prompt[1:4])
    assert np.abs(logits - reference).max() < 0.15 * np.abs(reference).max()


def test_q5_k_and_q5_1_layers_keep_their_blocks_in_five_bits(checkpoint_factory, tmp_path):
    """llama.cpp's Q5_K_M: Q5_K layers (and here Q5_1 values beside them) go in as int8 blocks with minimums holding
    the file's 5-bit values, scales and minimums (computed in float, the engine is the file's fp32 engine); with
    int8 activations each linear is an Int5MatMul node storing the file's values in 5 bits, Q5_K's scales and
    minimums factored as the file has them (uint8 sc and m, float16 d and -dmin: 5.625 bits a weight), Q5_1's
    float16 ones, the fused q/k/v split between the two."""
    import onnx

    source = make_gguf(
        tmp_path / "q5_k.gguf",
        checkpoint_factory("k_quants"),
        linear_type="Q5_K",
        module_types={"self_attn.v_proj": "Q5_1"},
    )
    fp32 = build(source, tmp_path / "fp32", quant="none")
    exact = build(source, tmp_path / "exact", int8_compute=False)
    assert exact.manifest.quantization.source_blocks_kept == {"Q5_K": 12, "Q5_1": 2, "Q8_0": 1}
    # in float, MatMulNBits computes scale x (q - 128) and the offset matmul adds 128 x scale x the block's sum back:
    # for values of 0..31 the two cancel to ~1/8 of their size, so float rounding shows ~8x more than for int4
    assert_computes_what(fp32, exact, tolerance=5e-4)

    engine = build(source, tmp_path / "auto")
    facts = engine.manifest.quantization
    assert (facts.method, facts.linears_kept, facts.linears_requantized, facts.linears_widened) == (
        "gguf-blocks",
        11,
        0,
        0,
    )
    model = onnx.load(str(engine.artifact.path(engine.manifest.graphs["step"].file)))
    five = [n for n in model.graph.node if n.op_type == "Int5MatMul"]
    assert len(five) == 2 * 5 and not {"MatMulNBits", "ReduceSum"} & {node.op_type for node in model.graph.node}
    values_parts = [n for n in five if "qkv_proj.parts.1" in n.input[1]]
    assert [len(n.input) for n in values_parts] == [4, 4]  # Q5_1: float16 scales and minimums
    stored, values = factored_o_proj(model, "Int5MatMul", source, "Q5_K")
    n = len(values)
    assert np.array_equal(untiled(stored, n, bits=5), five_bit_bytes(values.reshape(n, -1)).reshape(n, -1))
    stored = {
        out: sum(f.stat().st_size for f in (tmp_path / out).rglob("*") if f.is_file()) for out in ("auto", "exact")
    }
    assert stored["auto"] < 0.8 * stored["exact"]  # 5 bits a value against int8 MatMulNBits's 8
    prompt = fp32.codec.encode(TEXT)
    reference = teacher_forced_logits(exact, prompt, prompt[1:4])
    logits = teacher_forced_logits(engine, prompt, prompt[1:4])
    assert np.abs(logits - reference).max() < 0.15 * np.abs(reference).max()


def test_a_q6_k_layer_keeps_its_blocks_in_six_bits(checkpoint_factory, tmp_path):
    """llama.cpp's Q4_K_M gives some down projections Q6_K: they go in as int8 blocks of 16 holding the file's
    values and products d x sc (computed in float, the engine is the file's fp32 engine), and with int8 activations
    each is one Int6MatMul node storing the file's 6-bit values, int8 sc and float16 d (6.5625 bits a weight; the
    kernel against float64: tests/plugins/test_int4_matmul.py)."""
    import gguf
    import onnx
    from onnx import numpy_helper

    from plugins.int4_matmul import six_bit_bytes

    source, fp32, exact = q6_k_engines(checkpoint_factory, tmp_path, "mlp.down_proj")

    engine = build(source, tmp_path / "auto")
    model = onnx.load(str(engine.artifact.path(engine.manifest.graphs["step"].file)))
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("Int6MatMul") == 2 and "MatMulNBits" not in ops
    assert "Int6MatMul" in engine.manifest.graphs["step"].native_ops
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (down,) = [n for n in model.graph.node if n.op_type == "Int6MatMul" and "layers.1.mlp.down_proj" in n.input[1]]
    n = next(a.i for a in down.attribute if a.name == "N")
    raw = next(t for t in gguf.GGUFReader(str(source)).tensors if t.name == "blk.1.ffn_down.weight")
    values, scales, _ = BlockQuantized("Q6_K", np.asarray(raw.data), 512).to_matmul_nbits()
    multipliers, factors = (untiled(constants[name], n) for name in down.input[2:])
    assert multipliers.dtype == np.int8 and factors.dtype == np.float16
    products = np.repeat(factors.astype(np.float32), 16, axis=-1) * multipliers
    assert np.array_equal(products, scales.numpy().reshape(n, -1))
    stored = six_bit_bytes(values.numpy().reshape(n, -1) - np.uint8(96)).reshape(n, -1)
    assert np.array_equal(untiled(constants[down.input[1]], n, bits=6), stored)
    # told to keep onnxruntime's matmul, the same blocks run as its int8 MatMulNBits in blocks of 16
    theirs = build(source, tmp_path / "ort", native_quantized_matmul=False)
    model = onnx.load(str(theirs.artifact.path(theirs.manifest.graphs["step"].file)), load_external_data=False)
    downs = [n for n in model.graph.node if n.op_type == "MatMulNBits" and "down_proj" in n.input[1]]
    assert [next(a.i for a in n.attribute if a.name == "block_size") for n in downs] == [16, 16]
    prompt = fp32.codec.encode(TEXT)
    reference = teacher_forced_logits(exact, prompt, prompt[1:4])
    # both quantize the activations to int8 (onnxruntime per 16 inputs, ours per 32): near, not equal
    for int8_engine in (engine, theirs):
        logits = teacher_forced_logits(int8_engine, prompt, prompt[1:4])
        assert np.abs(logits - reference).max() < 0.15 * np.abs(reference).max()
