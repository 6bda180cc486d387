"""Int4MatMul / Int8MatMul / Int5MatMul / Int6MatMul, our onnxruntime CPU kernels for int4 (Q4_0, Q4_1 and Q4_K with
minimums), int8 (Q8_0), 5-bit (Q5_0, Q5_1 and Q5_K with minimums) and 6-bit (Q6_K) weights:
against float64 references and onnxruntime's MatMulNBits on the same weights, bit for bit the same for a row alone
and in any batch and on the AVX2 and VNNI tiles, which nodes they replace, and an int4 engine that therefore decodes
a lone row without padding it."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from plugins import int4_matmul, native_ops
from plugins.native_ops import DOMAIN

needs_kernel = pytest.mark.skipif(
    native_ops.unavailable_reason() is not None,
    reason=f"our kernels cannot be built here: {native_ops.unavailable_reason()}",
)
pytestmark = needs_kernel


def weights(n: int, k: int, block: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random int4 weights in MatMulNBits's layout (every nibble value, scales of both signs)."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8)
    return packed, (rng.random(n * k // block, dtype=np.float32) * 0.02 - 0.01)


def dequantized(packed: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    n, blocks, _ = packed.shape
    values = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, blocks, -1).astype(np.float32) - 8
    return (values * scales.reshape(n, blocks, 1)).reshape(n, k)


def session(
    library: Path,
    op: str,
    packed: np.ndarray,
    scales: np.ndarray,
    k: int,
    n: int,
    block: int,
    rank: int = 2,
    swiglu: int = 0,
    minimums: np.ndarray | None = None,
    tile: bool = True,
    factors: np.ndarray | None = None,
):
    """A session of one node. Our ops take their inputs in column tiles, as the build stores them (tile=False: the
    arrays go in as they are given)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    constants = [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(scales, "s")]
    if op == "Int6MatMul":  # packed: the 6-bit values [N, K]; scales: int8 multipliers [N, K / 16]
        tiled = int4_matmul.tile_weights(int4_matmul.six_bit_bytes(packed), 6) if tile else packed
        scales, factors = (int4_matmul.tile_per_block(v, n) if tile else v for v in (scales, factors))
        constants = [numpy_helper.from_array(tiled, "w"), numpy_helper.from_array(scales, "s")]
        constants.append(numpy_helper.from_array(factors, "f"))
        extra = {"swiglu": swiglu} if swiglu else {}
        node = helper.make_node(
            op,
            ["a", "w", "s", "f"],
            ["y"],
            domain=DOMAIN,
            K=k,
            N=n,
            block_size=block,
            column_tile=int4_matmul.COLUMN_TILE,
            **extra,
        )
    elif op in ("Int4MatMul", "Int8MatMul", "Int5MatMul"):
        if tile:  # Int5MatMul's packed: the 5-bit values [N, K]
            five_bit = op == "Int5MatMul"
            bytes_ = int4_matmul.five_bit_bytes(packed) if five_bit else packed
            packed = int4_matmul.tile_weights(bytes_, 5 if five_bit else 8 if op == "Int8MatMul" else 4)
            scales = int4_matmul.tile_per_block(scales, n)
            minimums = None if minimums is None else int4_matmul.tile_per_block(minimums, n)
            factors = None if factors is None else int4_matmul.tile_per_block(factors, n)
        constants = [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(scales, "s")]
        extra = {"swiglu": swiglu} if swiglu else {}
        inputs = ["a", "w", "s"] + ([] if minimums is None else ["m"]) + ([] if factors is None else ["f"])
        if minimums is not None:
            constants.append(numpy_helper.from_array(minimums, "m"))
        if factors is not None:
            constants.append(numpy_helper.from_array(factors, "f"))
        node = helper.make_node(
            op, inputs, ["y"], domain=DOMAIN, K=k, N=n, block_size=block, column_tile=int4_matmul.COLUMN_TILE, **extra
        )
    else:
        node = helper.make_node(
            op, ["a", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=block, accuracy_level=4
        )
    leading = ["rows"] if rank == 2 else ["batch", "rows"]
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [*leading, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*leading, n // 2 if swiglu else n])],
        constants,
    )
    model = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", 17),
            helper.make_opsetid("com.microsoft", 1),
            helper.make_opsetid(DOMAIN, 1),
        ],
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


SHAPES = {  # n, k, block: tiles of 4 columns and a tail, K with an odd number of 32-blocks, blocks sharing scales
    "default model's MLP": (96, 576, 32),
    "odd 32-blocks and column tail": (37, 96, 32),
    "blocks of 64": (70, 576, 64),
    "blocks of 128": (9, 512, 128),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 70])  # one, a partial row tile, more than one block of 64 rows
def test_it_computes_what_onnxruntimes_int8_path_computes(library, shape, rows):
    n, k, block = SHAPES[shape]
    packed, scales = weights(n, k, block)
    a = np.random.default_rng(rows).standard_normal((rows, k), dtype=np.float32)
    a[:, ::13] *= 30  # outliers, as hidden states have
    reference = a @ dequantized(packed, scales, k).T
    ours = session(library, "Int4MatMul", packed, scales, k, n, block).run(None, {"a": a})[0]
    theirs = session(library, "MatMulNBits", packed, scales, k, n, block).run(None, {"a": a})[0]
    scale = np.abs(reference).max()
    # int8 activations: ~1% of the output's scale against the float product, as onnxruntime's own int8 path
    assert np.abs(ours - reference).max() <= 0.03 * scale
    if block == 32:  # the same quantization of the activations: the same result up to float summation order
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("shape", SHAPES)
def test_float16_scales_compute_exactly_what_the_same_scales_in_float_compute(library, shape):
    """Engines store Int4MatMul's scales as float16 (int4_matmul.half_scales); the kernel widens them exactly."""
    n, k, block = SHAPES[shape]
    packed, scales = weights(n, k, block)
    half = scales.astype(np.float16)
    a = np.random.default_rng(1).standard_normal((70, k), dtype=np.float32)
    widened = session(library, "Int4MatMul", packed, half.astype(np.float32), k, n, block).run(None, {"a": a})[0]
    np.testing.assert_array_equal(
        session(library, "Int4MatMul", packed, half, k, n, block).run(None, {"a": a})[0], widened
    )


@pytest.mark.parametrize("n", [192, 2 * 37])  # the tiny models' MLP; halves of 37 columns (a scalar tail)
def test_swiglu_nodes_compute_silu_of_the_gate_times_up(library, n):
    k, block = 96, 32
    packed, scales = weights(n, k, block)
    a = np.random.default_rng(2).standard_normal((70, k), dtype=np.float32) * 30
    product = session(library, "Int4MatMul", packed, scales, k, n, block).run(None, {"a": a})[0].astype(np.float64)
    gate, up = product[:, : n // 2], product[:, n // 2 :]
    fused = session(library, "Int4MatMul", packed, scales, k, n, block, swiglu=1)
    out = fused.run(None, {"a": a})[0]
    np.testing.assert_allclose(out, gate / (1 + np.exp(-gate)) * up, rtol=2e-6, atol=1e-6 * np.abs(up).max())
    for rows in (slice(0, 1), slice(3, 7)):  # a row alone or in any batch: bit for bit
        np.testing.assert_array_equal(fused.run(None, {"a": a[rows]})[0], out[rows])


def test_the_build_folds_the_mlp_activation_into_the_gate_and_up_matmul(engine_factory):
    step = open_step_graph(engine_factory("gqa", quant="int4"))
    swiglu = [n for n in step.graph.node if n.op_type == "Int4MatMul" and any(a.name == "swiglu" for a in n.attribute)]
    assert len(swiglu) == 2  # a layer each
    assert not [n for n in step.graph.node if n.op_type in ("Split", "Sigmoid")]


@pytest.mark.parametrize("axis, folded", [(2, 1), (-1, 1), (None, 0), (1, 0)])  # None: Split's default, axis 0
def test_only_a_split_of_the_products_last_axis_is_folded(tmp_path, axis, folded):
    import onnx
    from onnx import TensorProto, helper

    attributes = {} if axis is None else {"axis": axis}
    nodes = [
        helper.make_node("Int4MatMul", ["a", "w", "s"], ["y"], domain=DOMAIN, K=64, N=8, block_size=32),
        helper.make_node("Split", ["y"], ["gate", "up"], num_outputs=2, **attributes),
        helper.make_node("Sigmoid", ["gate"], ["sigmoid"]),
        helper.make_node("Mul", ["gate", "sigmoid"], ["silu"]),
        helper.make_node("Mul", ["silu", "up"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "aws"],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
    )
    path = tmp_path / "mlp.onnx"
    onnx.save(helper.make_model(graph), str(path))
    assert int4_matmul.fuse_swiglu(path) == folded
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops == (["Int4MatMul"] if folded else ["Int4MatMul", "Split", "Sigmoid", "Mul", "Mul"])


def open_step_graph(engine: Path):
    import onnx

    from engines.format import open_artifact

    artifact = open_artifact(engine)
    return onnx.load(str(artifact.path(artifact.manifest.graphs["step"].file)), load_external_data=False)


def int8_activations(a: np.ndarray) -> np.ndarray:
    """The activations as the kernel quantizes them, computed independently: per row and block of 32 values,
    round(a x 127 / max|a|) (float32, half to even) times max|a| / 127, returned in float64."""
    blocks = a.reshape(a.shape[0], -1, 32)
    largest = np.abs(blocks).max(axis=-1, keepdims=True)
    inverse = np.where(largest > 0, np.float32(127) / np.where(largest > 0, largest, 1), 0).astype(np.float32)
    codes = np.rint(blocks * inverse)
    return (codes.astype(np.float64) * (largest / np.float32(127)).astype(np.float64)).reshape(a.shape)


def q4_1_blocks(n: int, k: int, seed: int = 0):
    """Random Q4_1-style blocks: every nibble value, float16 scales and minimums as a GGUF file holds them."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    scales = (rng.random(n * k // 32) * 0.02).astype(np.float16)
    minimums = (-rng.random((n, k // 32)) * 0.15 + 0.02).astype(np.float16)
    return packed, scales, minimums


def q4_k_blocks(n: int, k: int, seed: int = 0):
    """Random Q4_K-style sub-blocks: float32 scales d x sc and minimums -(dmin x m) of a float16 per 256 inputs and
    6-bit integers per 32, as llama.cpp computes them (float16 does not hold them)."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    d, dmin = (
        np.repeat((rng.random((n, -(-k // 256))) * f).astype(np.float16), 8, -1)[:, : k // 32] for f in (4e-4, 3e-3)
    )
    sc, m = rng.integers(0, 64, (2, n, k // 32))
    scales = (d.astype(np.float32) * sc.astype(np.float32)).reshape(-1)
    return packed, scales, -(dmin.astype(np.float32) * m.astype(np.float32))


def unpacked(packed: np.ndarray) -> np.ndarray:
    n, blocks, _ = packed.shape
    return np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, blocks, -1).astype(np.float64)


MINIMUM_SHAPES = {"the default model's MLP": (96, 576), "odd 32-blocks, odd N": (37, 96), "one pair of blocks": (9, 64)}


def vnni() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return all(flag in flags.split() for flag in ("avx512f", "avx512bw", "avx512_vnni"))


# the kernels' tiles: the CPU's best (AVX-512 VNNI where it has it) and the AVX2 ones every x86-64 CPU we support runs
ISAS = ["native", pytest.param("avx2", marks=pytest.mark.skipif(not vnni(), reason="no AVX-512 VNNI: native is AVX2"))]


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    if request.param == "avx2":  # read by the kernel when a session creates it
        monkeypatch.setenv("LLM_ENGINE_BUILDER_KERNEL_ISA", "avx2")
    return request.param


@pytest.mark.parametrize("shape", MINIMUM_SHAPES)
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_every_block_format_against_a_float64_reference_for_1_to_17_rows(library, shape, kind, isa):
    """scale * q + minimum (Q4_1: float16 scales and minimums; Q4_K: float32 ones) and scale * (q - 8) (Q4_0): the
    kernel's only rounding is the activations' int8 quantization, which the reference repeats; the rest is float
    summation order."""
    n, k = MINIMUM_SHAPES[shape]
    packed, scales, minimums = q4_k_blocks(n, k) if kind == "Q4_K" else q4_1_blocks(n, k)
    codes, s = unpacked(packed), scales.astype(np.float64).reshape(n, -1, 1)
    with_minimums = kind != "Q4_0"
    weight = codes * s + minimums.astype(np.float64)[..., None] if with_minimums else (codes - 8) * s
    run = session(library, "Int4MatMul", packed, scales, k, n, 32, minimums=minimums if with_minimums else None)
    a = np.random.default_rng(3).standard_normal((17, k), dtype=np.float32)
    a[:, ::13] *= 30
    reference = int8_activations(a) @ weight.reshape(n, k).T
    everything = run.run(None, {"a": a})[0]
    np.testing.assert_allclose(everything, reference, rtol=0, atol=2e-6 * np.abs(reference).max())
    for rows in range(1, 17):  # the first rows alone: bit for bit what they are among 17
        np.testing.assert_array_equal(run.run(None, {"a": a[:rows]})[0], everything[:rows])
    np.testing.assert_array_equal(run.run(None, {"a": a[5:6]})[0], everything[5:6])


def factored_q4_k(n: int, k: int, seed: int = 0):
    """q4_k_blocks with their scales and minimums factored as the build stores them: (packed, scale multipliers,
    minimum multipliers, factors [N, K / 256 x 2]), and the float32 products (scales, minimums) they stand for."""
    packed, scales, minimums = q4_k_blocks(n, k, seed)
    (scale_multipliers, scale_factors), (minimum_multipliers, minimum_factors) = (
        int4_matmul.factored_scales(values.reshape(n, -1)) for values in (scales, minimums)
    )
    factors = np.stack((scale_factors, minimum_factors), -1).reshape(n, -1)
    return (packed, scale_multipliers, minimum_multipliers, factors), (scales, minimums)


FACTORED_SHAPES = {"the default model's down projection": (96, 1536), "odd N, one super-block": (37, 256)}


@pytest.mark.parametrize("shape", FACTORED_SHAPES)
def test_factored_scales_compute_what_their_products_stored_as_floats_compute_bit_for_bit(library, shape, isa):
    """The kernel forms Q4_K's factored scales and minimums in float32 as it reads them: the same floats as the
    products stored, so the same outputs, for any number of rows (and so the float64 reference above holds for
    them)."""
    n, k = FACTORED_SHAPES[shape]
    (packed, multipliers, minimum_multipliers, factors), (scales, minimums) = factored_q4_k(n, k, seed=6)
    a = np.random.default_rng(7).standard_normal((70, k), dtype=np.float32)
    stored = session(library, "Int4MatMul", packed, scales, k, n, 32, minimums=minimums)
    factored = session(
        library, "Int4MatMul", packed, multipliers, k, n, 32, minimums=minimum_multipliers, factors=factors
    )
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 70):
        np.testing.assert_array_equal(factored.run(None, {"a": a[:rows]})[0], stored.run(None, {"a": a[:rows]})[0])


def test_factored_scales_of_the_wrong_size_type_or_k_are_refused(library):
    import onnxruntime as ort

    n, k = 37, 512
    (packed, multipliers, minimum_multipliers, factors), (scales, _) = factored_q4_k(n, k)
    a = np.ones((1, k), np.float32)
    bad_inputs = [
        (multipliers, minimum_multipliers, factors[:, :-1]),  # short factors
        (multipliers, minimum_multipliers, factors.astype(np.float32)),  # not float16
        (scales.reshape(n, -1), minimum_multipliers.astype(np.float32), factors),  # float scales beside factors
    ]
    state = ort.capi.onnxruntime_pybind11_state
    for scale_input, minimum_input, factor_input in bad_inputs:
        with pytest.raises((state.Fail, state.InvalidGraph, state.InvalidArgument)):
            session(
                library, "Int4MatMul", packed, scale_input, k, n, 32, minimums=minimum_input, factors=factor_input
            ).run(None, {"a": a})
    k = 96  # K not a multiple of 256
    (packed, multipliers, minimum_multipliers, _), _ = factored_q4_k(n, 256)
    with pytest.raises(state.Fail, match="multiple of 256"):
        session(
            library,
            "Int4MatMul",
            packed[:, :3],
            multipliers[:, :3],
            k,
            n,
            32,
            minimums=minimum_multipliers[:, :3],
            factors=np.zeros((n, 2), np.float16),
        ).run(None, {"a": np.ones((1, k), np.float32)})


def save_two_nodes(path: Path, nodes: list, constants: dict[str, np.ndarray], k: int) -> Path:
    """A graph of two matmul nodes reading input a [rows, K] and writing y and y2, saved at `path`."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        nodes,
        "two",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", "y2")],
        [numpy_helper.from_array(v, name) for name, v in constants.items()],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
    return path


def test_the_build_stores_float32_scales_factored_where_they_factor(library, tmp_path):
    """`use_in_graph` on two nodes with float32 scales and minimums: Q4_K's products are stored factored (a fifth
    input), anything else as float32; both compute what they did before."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    n, k = 37, 512
    _, (scales, minimums) = factored_q4_k(n, k)
    packed = q4_k_blocks(n, k)[0]
    unshared = scales.copy()
    unshared[5] = np.nextafter(unshared[5], np.float32(1))  # no longer a float16 of its super-block times an integer
    constants = {"w": packed, "s": scales, "m": minimums, "s2": unshared, "m2": minimums.copy(), "w2": packed.copy()}
    nodes = [
        helper.make_node("Int4MatMul", ["a", *inputs], [out], domain=DOMAIN, K=k, N=n, block_size=32, name=out)
        for inputs, out in ((["w", "s", "m"], "y"), (["w2", "s2", "m2"], "y2"))
    ]
    path = save_two_nodes(tmp_path / "two.onnx", nodes, constants, k)
    int4_matmul.use_in_graph(path)
    model = onnx.load(str(path))
    inputs = {node.name: list(node.input) for node in model.graph.node}
    assert inputs == {"y": ["a", "w", "s", "m", "s/factors"], "y2": ["a", "w2", "s2", "m2"]}
    types = {t.name: t.data_type for t in model.graph.initializer}
    assert (types["s"], types["m"], types["s/factors"]) == (TensorProto.UINT8, TensorProto.UINT8, TensorProto.FLOAT16)
    assert types["s2"] == types["m2"] == TensorProto.FLOAT
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    a = np.random.default_rng(4).standard_normal((3, k), dtype=np.float32)
    y, y2 = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"a": a})
    np.testing.assert_array_equal(
        y, session(library, "Int4MatMul", packed, scales, k, n, 32, minimums=minimums).run(None, {"a": a})[0]
    )
    np.testing.assert_array_equal(
        y2, session(library, "Int4MatMul", packed, unshared, k, n, 32, minimums=minimums).run(None, {"a": a})[0]
    )


def test_factored_scales_factor_exactly_or_not_at_all():
    rng = np.random.default_rng(1)
    d = rng.random((3, 2)).astype(np.float16) * np.float16(0.01)
    sc = rng.integers(0, 64, (3, 16))
    sc[0, :8] = 0  # a super-block of zero scales
    products = d.astype(np.float32).repeat(8, -1) * sc.astype(np.float32)
    multipliers, factors = int4_matmul.factored_scales(products)
    assert multipliers.dtype == np.uint8 and factors.dtype == np.float16 and factors.shape == (3, 2)
    np.testing.assert_array_equal(factors.astype(np.float32).repeat(8, -1) * multipliers, products)
    assert int4_matmul.factored_scales(-products)[0].max() < 256  # negative factors: -(dmin x m)
    assert int4_matmul.factored_scales(rng.random((3, 16), dtype=np.float32)) is None  # independent floats
    unshared = products.copy()
    unshared[1, 3] = np.float32(np.float16(0.003)) * 7  # one value off its super-block's float16
    assert int4_matmul.factored_scales(unshared) is None


def test_minimums_fold_into_the_swiglu_node_too(library):
    n, k = 192, 96
    packed, scales, minimums = q4_1_blocks(n, k, seed=4)
    a = np.random.default_rng(5).standard_normal((6, k), dtype=np.float32)
    product = session(library, "Int4MatMul", packed, scales, k, n, 32, minimums=minimums).run(None, {"a": a})[0]
    fused = session(library, "Int4MatMul", packed, scales, k, n, 32, swiglu=1, minimums=minimums)
    gate, up = product[:, : n // 2].astype(np.float64), product[:, n // 2 :]
    np.testing.assert_allclose(fused.run(None, {"a": a})[0], gate / (1 + np.exp(-gate)) * up, rtol=2e-6, atol=1e-6)


def test_minimums_of_the_wrong_size_type_or_block_are_refused(library):
    import onnxruntime as ort

    n, k = 37, 96
    packed, scales, minimums = q4_1_blocks(n, k)
    tiled = int4_matmul.tile_weights(packed, 4), int4_matmul.tile_per_block(scales, n)
    good = int4_matmul.tile_per_block(minimums, n)
    a = np.ones((1, k), np.float32)
    for bad in (good[:-1], good.astype(np.float32), minimums):  # short, not the scales' type, not padded
        state = ort.capi.onnxruntime_pybind11_state
        with pytest.raises((state.Fail, state.InvalidGraph)):
            session(library, "Int4MatMul", *tiled, k, n, 32, minimums=bad, tile=False).run(None, {"a": a})
    packed, scales, minimums = q4_1_blocks(n, 128)  # as blocks of 64: minimums are for blocks of 32 only
    wide = packed.reshape(n, 2, 32)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="blocks of 32"):
        session(library, "Int4MatMul", wide, scales[: n * 2], 128, n, 64, minimums=minimums).run(
            None, {"a": np.ones((1, 128), np.float32)}
        )


def test_scales_of_the_wrong_size_or_type_are_refused(library):
    import onnxruntime as ort

    n, k, block = SHAPES["default model's MLP"]
    packed, scales = weights(n, k, block)
    tiled = int4_matmul.tile_per_block(scales, n)
    a = np.ones((1, k), np.float32)
    for bad in (tiled[:-1], tiled.astype(np.float64)):
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="scales must be N"):
            session(library, "Int4MatMul", int4_matmul.tile_weights(packed, 4), bad, k, n, block, tile=False).run(
                None, {"a": a}
            )


def test_a_node_without_column_tiles_is_refused_with_a_rebuild_hint(library):
    """An engine from a builder that stored MatMulNBits's order (no column_tile attribute) must not run on it."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    n, k, block = SHAPES["default model's MLP"]
    packed, scales = weights(n, k, block)
    node = helper.make_node("Int4MatMul", ["a", "w", "s"], ["y"], domain=DOMAIN, K=k, N=n, block_size=block)
    graph = helper.make_graph(
        [node],
        "untiled",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])],
        [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(scales, "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.RuntimeException, match="column tiles of 16.*rebuild it"):
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_half_scales_keeps_float_where_float16_would_overflow():
    assert int4_matmul.half_scales(np.array([1e-3, 0.5], np.float32)).dtype == np.float16
    assert int4_matmul.half_scales(np.array([1e-3, 1e5], np.float32)) is None


def test_a_row_computes_the_same_alone_and_in_any_batch(library):
    n, k, block = SHAPES["odd 32-blocks and column tail"]
    packed, scales = weights(n, k, block)
    run = session(library, "Int4MatMul", packed, scales, k, n, block, rank=3)
    a = np.random.default_rng(0).standard_normal((2, 70, k), dtype=np.float32)
    everything = run.run(None, {"a": a})[0]
    for batch, rows in ((0, slice(0, 1)), (1, slice(69, 70)), (0, slice(2, 7)), (1, slice(30, 70))):
        np.testing.assert_array_equal(run.run(None, {"a": a[batch : batch + 1, rows]})[0][0], everything[batch, rows])
    assert run.run(None, {"a": a[:, :0]})[0].shape == (2, 0, n)


def test_it_covers_int4_and_int8_with_int8_activations_in_blocks_of_32_and_more():
    base = {"bits": 4, "accuracy_level": 4, "block_size": 32, "K": 576}
    assert int4_matmul.kernel_for(base, 3) == "Int4MatMul"
    assert int4_matmul.kernel_for(base | {"block_size": 64}, 3) == "Int4MatMul"
    assert int4_matmul.kernel_for(base | {"bits": 8}, 3) == "Int8MatMul"
    assert int4_matmul.kernel_for(base | {"bits": 2}, 3) is None
    assert int4_matmul.kernel_for(base | {"accuracy_level": 0}, 3) is None  # fp32 compute rounds differently
    assert int4_matmul.kernel_for(base | {"block_size": 16}, 3) is None
    assert int4_matmul.kernel_for(base | {"block_size": 128}, 3) is None  # does not divide 576
    assert int4_matmul.kernel_for(base | {"block_size": 96}, 3) is None  # not a power of 2
    assert int4_matmul.kernel_for(base, 4) is None  # zero points


INT8_SHAPES = {  # n, k, block
    "Q8_0 LM head slice": (70, 576, 32),
    "odd 32-blocks, odd N": (37, 96, 32),
    "blocks of 128 (int8 RTN)": (9, 512, 128),
}


@pytest.mark.parametrize("shape", INT8_SHAPES)
def test_int8_weights_against_a_float64_reference_for_1_to_17_rows(library, shape, isa):
    """MatMulNBits's 8-bit blocks (q + 128 as uint8, w = scale * q; GGUF Q8_0): every code from -128 to 127."""
    n, k, block = INT8_SHAPES[shape]
    rng = np.random.default_rng(6)
    codes = rng.integers(0, 256, (n, k // block, block), dtype=np.uint8)
    scales = (rng.random(n * k // block) * 0.01 - 0.005).astype(np.float16)
    weight = (codes.astype(np.float64) - 128) * scales.astype(np.float64).reshape(n, -1, 1)
    run = session(library, "Int8MatMul", codes, scales, k, n, block)
    a = rng.standard_normal((17, k), dtype=np.float32)
    a[:, ::13] *= 30
    reference = int8_activations(a) @ weight.reshape(n, k).T
    everything = run.run(None, {"a": a})[0]
    np.testing.assert_allclose(everything, reference, rtol=0, atol=2e-6 * np.abs(reference).max())
    for rows in range(1, 17):
        np.testing.assert_array_equal(run.run(None, {"a": a[:rows]})[0], everything[:rows])
    np.testing.assert_array_equal(run.run(None, {"a": a[9:10]})[0], everything[9:10])
    float_scales = session(library, "Int8MatMul", codes, scales.astype(np.float32), k, n, block)
    np.testing.assert_array_equal(float_scales.run(None, {"a": a})[0], everything)


def test_int8_scales_become_float16_only_where_that_is_exact():
    assert int4_matmul.exact_half_scales(np.array([1e-3, 0.5], np.float16).astype(np.float32)).dtype == np.float16
    assert int4_matmul.exact_half_scales(np.array([1e-3, 0.5], np.float32)) is None


def test_an_int4_engine_runs_it_in_every_matmul_and_pads_no_lone_row(engine_factory):
    import onnx

    from runner import LLM, SamplingParams

    llm = LLM(str(engine_factory("gqa", quant="int4")))
    step = llm.engine.manifest.graphs["step"]
    assert step.native_ops == ["DecodeAttention", "Int4MatMul", "QuantizedRows", "ArgMax", "SkipRmsNorm"]
    assert llm.engine.executor.min_rows == 1  # the probe found a lone row rounds as it does in a batch
    graph = onnx.load(str(llm.engine.artifact.path(step.file)), load_external_data=False)
    scales = {node.input[2] for node in graph.graph.node if node.op_type == "Int4MatMul"}
    types = {t.name: t.data_type for t in graph.graph.initializer if t.name in scales}
    # float16, the tied head's too: the embedding lookup reads them as the head's node does
    assert "lm_head.scales" in types and set(types.values()) == {onnx.TensorProto.FLOAT16}
    (lookup,) = [node for node in graph.graph.node if "lm_head.scales" in node.input and node.op_type != "Int4MatMul"]
    assert lookup.op_type == "QuantizedRows"
    prompts = [[5, 6, 7, 8, 9], [11, 3, 4], [1, 2]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)] == alone


def test_a_build_machine_without_avx2_keeps_onnxruntimes_matmul(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx fma\n")
    assert int4_matmul.unavailable_reason(cpuinfo) == "this CPU lacks AVX2 and F16C, which the kernel needs"
    cpuinfo.write_text("flags\t\t: fpu sse2 avx avx2 fma\n")
    assert int4_matmul.unavailable_reason(cpuinfo) == "this CPU lacks F16C, which the kernel needs"
    cpuinfo.write_text("flags\t\t: fpu sse2 avx avx2 fma f16c\n")
    assert int4_matmul.unavailable_reason(cpuinfo) is None


def test_engines_keep_onnxruntimes_matmul_when_told(engine_factory):
    from engines.format import open_artifact

    step = open_artifact(engine_factory("gqa", quant="int4", native_quantized_matmul=False)).manifest.graphs["step"]
    assert "Int4MatMul" not in step.native_ops


# every kind of tile: int4 with float16 or float32 scales, with or without minimums, factored; int8
TILE_KINDS = [
    "Int4MatMul",
    "Int4MatMul with float32 scales",
    "Int4MatMul with minimums",
    "Int4MatMul with float32 minimums",
    "Int4MatMul with factored minimums",
    "Int8MatMul",
    "Int8MatMul with float32 scales",
]


def tile_kind_node(library: Path, op: str, n: int, k: int):
    """A one-node session of the tile kind `op` names (TILE_KINDS) and its K (the factored kind's K is a multiple
    of 256: k rounded down to one, at least 256)."""
    packed, scales, minimums = q4_k_blocks(n, k) if "float32 minimums" in op else q4_1_blocks(n, k)
    if op.startswith("Int8MatMul"):
        packed = np.random.default_rng(8).integers(0, 256, (n, k // 32, 32), dtype=np.uint8)
    if "float32 scales" in op:
        scales = scales.astype(np.float32)
    extra = {"minimums": minimums} if "minimums" in op else {}
    if "factored" in op:
        k = max(256, k // 256 * 256)
        (packed, scales, minimums, factors), _ = factored_q4_k(n, k)
        extra = {"minimums": minimums, "factors": factors}
    return session(library, op.split()[0], packed, scales, k, n, 32, **extra), k


@pytest.mark.skipif(not vnni(), reason="no AVX-512 VNNI here: the kernels run their AVX2 tiles only")
@pytest.mark.parametrize("op", TILE_KINDS)
def test_the_vnni_tiles_compute_what_the_avx2_tiles_compute_bit_for_bit(library, monkeypatch, op):
    """vpdpbusd sums the same integer products as vpmaddubsw + vpmaddwd (which never saturate here), so an engine
    answers alike on both kinds of CPU."""
    isa = ctypes.CDLL(str(library)).QuantizedMatMulIsa
    isa.restype = ctypes.c_char_p
    assert isa() == b"avx512vnni"
    run, k = tile_kind_node(library, op, 70, 576)
    a = np.random.default_rng(9).standard_normal((9, k), dtype=np.float32) * 4
    native = run.run(None, {"a": a})[0]
    monkeypatch.setenv("LLM_ENGINE_BUILDER_KERNEL_ISA", "avx2")
    assert isa() == b"avx2"
    np.testing.assert_array_equal(tile_kind_node(library, op, 70, 576)[0].run(None, {"a": a})[0], native)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
def test_a_rows_node_reads_its_heads_inputs_as_the_build_stores_them(library, tmp_path, kind):
    """A tied head's blocks are the embedding table too: after `use_in_graph`, the QuantizedRows node exported
    beside the head reads the head's node's inputs in their stored form (Q4_1: float16 scales and minimums; Q4_K:
    factored, a fifth input) and returns the rows the reference dequantizes; a Gather of them is refused."""
    import onnx
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper, numpy_helper

    from plugins.quant_linear import dequantized_rows

    n, k = 37, 256  # a column tail, one Q4_K super-block
    packed, scales, minimums = q4_k_blocks(n, k) if kind == "Q4_K" else q4_1_blocks(n, k)
    scales = scales.astype(np.float32)  # as the export holds them
    nodes = [
        helper.make_node("Int4MatMul", ["a", "w", "s", "m"], ["y"], domain=DOMAIN, K=k, N=n, block_size=32),
        helper.make_node(
            "QuantizedRows", ["ids", "w", "s", "m"], ["rows"], domain=DOMAIN, K=k, N=n, bits=4, block_size=32
        ),
    ]
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["rows", k])]
    inputs.append(helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 5]))
    graph = helper.make_graph(
        nodes,
        "head",
        inputs,
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", "rows")],
        [numpy_helper.from_array(v, name) for name, v in (("w", packed), ("s", scales), ("m", minimums))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    path = tmp_path / "head.onnx"
    onnx.save(model, str(path))
    counts = int4_matmul.use_in_graph(path)
    assert counts == {"Int4MatMul": 1, "Int8MatMul": 0, "Int6MatMul": 0, "Int5MatMul": 0, "QuantizedRows": 1}
    head, rows = onnx.load(str(path)).graph.node
    assert rows.input[1:] == head.input[1:] and len(head.input) == (5 if kind == "Q4_K" else 4)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    run = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ids = np.array([[0, 36, 17, 16, 15]], np.int64)
    _, looked_up = run.run(None, {"a": np.ones((1, k), np.float32), "ids": ids})
    stored = scales.astype(np.float16).astype(np.float32) if kind == "Q4_1" else scales  # as the build stores them
    reference = dequantized_rows(
        *(torch.from_numpy(np.ascontiguousarray(v)) for v in (ids, packed, stored, minimums)), k, 4
    )
    np.testing.assert_array_equal(looked_up, reference.numpy())

    nodes[1] = helper.make_node("Gather", ["w", "ids"], ["rows"], axis=0)
    graph = helper.make_graph(nodes, "head", inputs, list(graph.output), list(graph.initializer))
    onnx.save(helper.make_model(graph, opset_imports=model.opset_import), str(path))
    with pytest.raises(ValueError, match="Gather node .* reads 'w'"):
        int4_matmul.use_in_graph(path)


def q6_k_blocks(n: int, k: int, seed: int = 0):
    """Random Q6_K-style weights: 6-bit values [N, K] (w = d x sc x (q - 32)), int8 multipliers sc per 16 inputs of
    either sign (-128 included), float16 factors d per 256."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 64, (n, k), dtype=np.uint8)
    multipliers = rng.integers(-128, 128, (n, k // 16), dtype=np.int8)
    factors = (rng.random((n, k // 256)) * 2e-4 - 1e-4).astype(np.float16)
    return values, multipliers, factors


def q6_k_weight(values, multipliers, factors) -> np.ndarray:
    n, k = values.shape
    scales = np.repeat(factors.astype(np.float64), 16, -1) * multipliers.astype(np.float64)
    return ((values.astype(np.float64) - 32).reshape(n, -1, 16) * scales[..., None]).reshape(n, k)


SIX_BIT_SHAPES = {"the default model's down projection": (96, 1536), "odd N, one super-block": (37, 256)}


@pytest.mark.parametrize("shape", SIX_BIT_SHAPES)
def test_six_bit_weights_against_a_float64_reference_for_1_to_17_rows(library, shape, isa):
    """Int6MatMul, Q6_K's blocks: its integer sums are exact, so the activations' int8 quantization (repeated by the
    reference) and float rounding are all that differ; a row's result is the same alone and among others."""
    n, k = SIX_BIT_SHAPES[shape]
    values, multipliers, factors = q6_k_blocks(n, k)
    run = session(library, "Int6MatMul", values, multipliers, k, n, 16, factors=factors)
    assert_reference_in_any_batch(run, q6_k_weight(values, multipliers, factors))


def assert_reference_in_any_batch(run, weight: np.ndarray) -> None:
    """`run` (a session of one matmul node) on 17 rows gives their int8 quantization x `weight`^T (float64), and
    each leading run of those rows, and row 5 alone, what they give among the 17, bit for bit."""
    a = np.random.default_rng(3).standard_normal((17, weight.shape[1]), dtype=np.float32)
    a[:, ::13] *= 30
    reference = int8_activations(a) @ weight.T
    everything = run.run(None, {"a": a})[0]
    np.testing.assert_allclose(everything, reference, rtol=0, atol=2e-6 * np.abs(reference).max())
    for rows in range(1, 17):
        np.testing.assert_array_equal(run.run(None, {"a": a[:rows]})[0], everything[:rows])
    np.testing.assert_array_equal(run.run(None, {"a": a[5:6]})[0], everything[5:6])


def test_six_bit_inputs_of_the_wrong_size_type_or_block_are_refused(library):
    import onnxruntime as ort

    n, k = 37, 512
    values, multipliers, factors = q6_k_blocks(n, k)
    state = ort.capi.onnxruntime_pybind11_state
    a = np.ones((1, k), np.float32)
    for multiplier_input, factor_input in (
        (multipliers.view(np.uint8), factors),  # not int8
        (multipliers, factors[:, :-1]),  # short factors
        (multipliers, factors.astype(np.float32)),  # not float16
        (multipliers[:, :-1], factors),  # short multipliers
    ):
        with pytest.raises((state.Fail, state.InvalidGraph, state.InvalidArgument)):
            session(library, "Int6MatMul", values, multiplier_input, k, n, 16, factors=factor_input).run(None, {"a": a})
    with pytest.raises(state.RuntimeException, match="block_size must be 16"):  # when the session creates it
        session(library, "Int6MatMul", values, multipliers, k, n, 32, factors=factors).run(None, {"a": a})
    with pytest.raises(state.RuntimeException, match="multiple of 256"):
        session(library, "Int6MatMul", values[:, :96], multipliers[:, :6], 96, n, 16, factors=factors[:, :1]).run(
            None, {"a": a[:, :96]}
        )


def test_six_bit_weights_fold_the_swiglu_activation_too(library):
    n, k = 64, 512
    values, multipliers, factors = q6_k_blocks(n, k, seed=2)
    a = np.random.default_rng(5).standard_normal((3, k), dtype=np.float32)
    y = session(library, "Int6MatMul", values, multipliers, k, n, 16, factors=factors).run(None, {"a": a})[0]
    fused = session(library, "Int6MatMul", values, multipliers, k, n, 16, factors=factors, swiglu=1)
    gate, up = y[:, : n // 2], y[:, n // 2 :]
    np.testing.assert_allclose(fused.run(None, {"a": a})[0], gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-6)


def test_signed_multipliers_factor_q6_k_scales_exactly_or_not_at_all():
    """Q6_K's scales d x sc: sc int8 of either sign, -128 included (llama.cpp gives the largest scale -128)."""
    rng = np.random.default_rng(2)
    d = (rng.random((3, 2)) * 0.01 - 0.005).astype(np.float16)
    sc = rng.integers(-128, 128, (3, 32))
    sc[1, 16:] = 0  # a super-block of zero scales
    products = d.astype(np.float32).repeat(16, -1) * sc.astype(np.float32)
    multipliers, factors = int4_matmul.factored_scales(products, 16, signed=True)
    assert multipliers.dtype == np.int8 and factors.shape == (3, 2)
    np.testing.assert_array_equal(factors.astype(np.float32).repeat(16, -1) * multipliers, products)
    assert int4_matmul.factored_scales(products, 16) is None  # unsigned multipliers cannot hold both signs
    unshared = products.copy()
    unshared[2, 3] = np.nextafter(unshared[2, 3], np.float32(1))
    assert int4_matmul.factored_scales(unshared, 16, signed=True) is None


def test_the_build_stores_only_q6_k_blocks_in_six_bits(library, tmp_path):
    """`use_in_graph` on two int8 MatMulNBits nodes in blocks of 16: the one holding Q6_K's values and products
    becomes an Int6MatMul node (6-bit tiles, int8 multipliers, float16 factors) computing its float64 reference; one
    whose values need 8 bits stays onnxruntime's."""
    import onnx
    from onnx import TensorProto, numpy_helper

    n, k = 37, 512
    values, multipliers, factors = q6_k_blocks(n, k, seed=4)
    weight = q6_k_weight(values, multipliers, factors)
    stored = (values.astype(np.int16) + 96).astype(np.uint8).reshape(n, -1, 16)
    scales = (np.repeat(factors.astype(np.float32), 16, -1) * multipliers).reshape(-1)
    wide = stored.copy()
    wide[0, 0, 0] = 200  # q - 32 beyond 6 bits
    constants = {"w": stored, "s": scales, "w2": wide, "s2": scales.copy()}
    path = save_two_int8_nodes(tmp_path / "two.onnx", constants, k, n, 16)
    assert int4_matmul.use_in_graph(path)["Int6MatMul"] == 1
    model = onnx.load(str(path))
    nodes = {node.name: (node.op_type, list(node.input)) for node in model.graph.node}
    assert nodes == {"y": ("Int6MatMul", ["a", "w", "s", "s/factors"]), "y2": ("MatMulNBits", ["a", "w2", "s2"])}
    tensors = {t.name: t for t in model.graph.initializer}
    assert (tensors["s"].data_type, tensors["s/factors"].data_type) == (TensorProto.INT8, TensorProto.FLOAT16)
    assert numpy_helper.to_array(tensors["w"]).size == -(-n // 16) * 16 * k * 6 // 8
    assert_first_output_is(library, path, weight)


def save_two_int8_nodes(path: Path, constants: dict[str, np.ndarray], k: int, n: int, block: int) -> Path:
    """Two int8 MatMulNBits nodes (int8 activations) y = a x (w, s) and y2 = a x (w2, s2), saved at `path`."""
    from onnx import helper

    nodes = [
        helper.make_node(
            "MatMulNBits",
            ["a", *inputs],
            [out],
            domain="com.microsoft",
            name=out,
            K=k,
            N=n,
            bits=8,
            block_size=block,
            accuracy_level=4,
        )
        for inputs, out in ((["w", "s"], "y"), (["w2", "s2"], "y2"))
    ]
    return save_two_nodes(path, nodes, constants, k)


def assert_first_output_is(library: Path, path: Path, weight: np.ndarray, output: int = 0) -> None:
    """The graph at `path` run on three random rows gives y (`output` 1: y2) = their int8 quantization x
    `weight`^T (float64)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    a = np.random.default_rng(4).standard_normal((3, weight.shape[1]), dtype=np.float32)
    y = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"a": a})[output]
    reference = int8_activations(a) @ weight.T
    np.testing.assert_allclose(y, reference, rtol=0, atol=2e-6 * np.abs(reference).max())


def q5_0_blocks(n: int, k: int, seed: int = 0):
    """Random Q5_0-style blocks: 5-bit values [N, K] (w = scale x (q - 16)), every value, float16 scales of both
    signs per 32 inputs."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 32, (n, k), dtype=np.uint8)
    values[0, :32] = np.arange(32)
    scales = (rng.random((n, k // 32)) * 0.02 - 0.01).astype(np.float16)
    return values, scales


def q5_0_weight(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    n, k = values.shape
    codes = values.astype(np.float64).reshape(n, -1, 32) - 16
    return (codes * scales.astype(np.float64)[..., None]).reshape(n, k)


FIVE_BIT_SHAPES = {"the default model's q/k/v": (960, 576), "odd N, one block": (37, 32)}


@pytest.mark.parametrize("shape", FIVE_BIT_SHAPES)
def test_five_bit_weights_against_a_float64_reference_for_1_to_17_rows(library, shape, isa):
    """Int5MatMul, Q5_0's blocks (float16 scales, and float ones): exact integer sums, so the activations' int8
    quantization (repeated by the reference) and float rounding are all that differ; a row's result is the same
    alone and among others."""
    n, k = FIVE_BIT_SHAPES[shape]
    values, scales = q5_0_blocks(n, k, seed=2)
    for stored in (scales, scales.astype(np.float32)):
        run = session(library, "Int5MatMul", values, stored.reshape(-1), k, n, 32)
        assert_reference_in_any_batch(run, q5_0_weight(values, scales))


def test_five_bit_weights_fold_the_swiglu_activation_too(library):
    n, k = 64, 256
    values, scales = q5_0_blocks(n, k, seed=4)
    a = np.random.default_rng(5).standard_normal((3, k), dtype=np.float32)
    y = session(library, "Int5MatMul", values, scales.reshape(-1), k, n, 32).run(None, {"a": a})[0]
    fused = session(library, "Int5MatMul", values, scales.reshape(-1), k, n, 32, swiglu=1)
    gate, up = y[:, : n // 2], y[:, n // 2 :]
    np.testing.assert_allclose(fused.run(None, {"a": a})[0], gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-6)


def q5_k_blocks(n: int, k: int, seed: int = 0):
    """Random Q5_K-style sub-blocks: 5-bit values [N, K] (w = scale x q + minimum), float32 scales d x sc and
    minimums -(dmin x m) of a float16 per 256 inputs and 6-bit integers per 32, as llama.cpp computes them."""
    _, scales, minimums = q4_k_blocks(n, k, seed)
    values = np.random.default_rng(seed + 1).integers(0, 32, (n, k), dtype=np.uint8)
    return values, scales.reshape(n, -1), minimums


def q5_1_blocks(n: int, k: int, seed: int = 0):
    """Random Q5_1-style blocks: 5-bit values [N, K], float16 scales and minimums as a GGUF file holds them."""
    _, scales, minimums = q4_1_blocks(n, k, seed)
    values = np.random.default_rng(seed + 1).integers(0, 32, (n, k), dtype=np.uint8)
    return values, scales.reshape(n, -1), minimums


def with_minimums_weight(values: np.ndarray, scales: np.ndarray, minimums: np.ndarray) -> np.ndarray:
    n, k = values.shape
    codes = values.astype(np.float64).reshape(n, -1, 32)
    weight = codes * scales.astype(np.float64)[..., None] + minimums.astype(np.float64)[..., None]
    return weight.reshape(n, k)


@pytest.mark.parametrize("shape", FACTORED_SHAPES)
@pytest.mark.parametrize("kind", ["Q5_1", "Q5_K"])
def test_five_bit_weights_with_minimums_against_a_float64_reference_for_1_to_17_rows(library, shape, kind, isa):
    """Int5MatMul with minimums, w = scale x q + minimum (Q5_1: float16 scales and minimums; Q5_K: float32
    products d x sc and -(dmin x m), and those factored as the build stores them, bit for bit the same outputs):
    exact integer sums, so the activations' int8 quantization and float rounding are all that differ, and a row's
    result is the same alone and among others."""
    n, k = FACTORED_SHAPES[shape]
    values, scales, minimums = q5_1_blocks(n, k, seed=2) if kind == "Q5_1" else q5_k_blocks(n, k, seed=2)
    run = session(library, "Int5MatMul", values, scales.reshape(-1), k, n, 32, minimums=minimums)
    assert_reference_in_any_batch(run, with_minimums_weight(values, scales, minimums))
    if kind == "Q5_K":
        (multipliers, scale_factors), (minimum_multipliers, minimum_factors) = (
            int4_matmul.factored_scales(v) for v in (scales, minimums)
        )
        factors = np.stack((scale_factors, minimum_factors), -1).reshape(n, -1)
        factored = session(
            library, "Int5MatMul", values, multipliers, k, n, 32, minimums=minimum_multipliers, factors=factors
        )
        a = np.random.default_rng(7).standard_normal((70, k), dtype=np.float32)
        for rows in (1, 3, 4, 5, 70):
            np.testing.assert_array_equal(factored.run(None, {"a": a[:rows]})[0], run.run(None, {"a": a[:rows]})[0])


def test_five_bit_weights_with_minimums_fold_the_swiglu_activation_too(library):
    n, k = 64, 256
    values, scales, minimums = q5_k_blocks(n, k, seed=4)
    a = np.random.default_rng(5).standard_normal((3, k), dtype=np.float32)
    y = session(library, "Int5MatMul", values, scales.reshape(-1), k, n, 32, minimums=minimums).run(None, {"a": a})[0]
    fused = session(library, "Int5MatMul", values, scales.reshape(-1), k, n, 32, minimums=minimums, swiglu=1)
    gate, up = y[:, : n // 2].astype(np.float64), y[:, n // 2 :]
    np.testing.assert_allclose(fused.run(None, {"a": a})[0], gate / (1 + np.exp(-gate)) * up, rtol=2e-6, atol=1e-6)


def test_int8_weights_with_minimums_are_refused(library):
    """Only Int5MatMul takes minimums of int8 nodes (the graph stage stores their 5-bit values so)."""
    import onnxruntime as ort

    n, k = 37, 256
    values, scales, minimums = q5_1_blocks(n, k)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="Int8MatMul: takes 3 inputs"):
        session(library, "Int8MatMul", values.reshape(n, -1, 32), scales.reshape(-1), k, n, 32, minimums=minimums).run(
            None, {"a": np.ones((1, k), np.float32)}
        )


def test_five_bit_inputs_of_the_wrong_size_or_count_are_refused(library):
    import onnxruntime as ort

    n, k = 37, 256
    values, scales = q5_0_blocks(n, k)
    state = ort.capi.onnxruntime_pybind11_state
    a = np.ones((1, k), np.float32)
    tiled = int4_matmul.tile_weights(int4_matmul.five_bit_bytes(values), 5)
    tiled_scales = int4_matmul.tile_per_block(scales, n)
    for weight_input, scale_input, minimums in (
        (tiled[:-1], tiled_scales, None),  # short weights
        (tiled, tiled_scales[:-1], None),  # short scales
        (tiled, tiled_scales, tiled_scales[:-1]),  # short minimums
        (tiled, tiled_scales, tiled_scales.astype(np.float32)),  # minimums of another type than the scales
    ):
        with pytest.raises((state.Fail, state.InvalidGraph, state.InvalidArgument)):
            session(library, "Int5MatMul", weight_input, scale_input, k, n, 32, minimums=minimums, tile=False).run(
                None, {"a": a}
            )


def test_the_build_stores_only_five_bit_int8_blocks_in_five_bits(library, tmp_path):
    """`use_in_graph` on two int8 MatMulNBits nodes in blocks of 32: the one whose values fit 5 bits (Q5_0's, stored
    q + 128 of 112..143) becomes an Int5MatMul node (5-bit tiles, float16 scales: 5.5 bits a weight) computing its
    float64 reference; one whose values need 8 bits stays Int8MatMul."""
    import onnx
    from onnx import numpy_helper

    n, k = 37, 256
    values, scales = q5_0_blocks(n, k, seed=6)
    stored = (values.astype(np.int16) + 112).astype(np.uint8).reshape(n, -1, 32)
    wide = stored.copy()
    wide[3, 2, 1] = 144  # q beyond 5 bits
    constants = {"w": stored, "s": scales.astype(np.float32).reshape(-1), "w2": wide}
    constants["s2"] = constants["s"].copy()
    path = save_two_int8_nodes(tmp_path / "two.onnx", constants, k, n, 32)
    counts = int4_matmul.use_in_graph(path)
    assert (counts["Int5MatMul"], counts["Int8MatMul"]) == (1, 1)
    model = onnx.load(str(path))
    assert {node.name: node.op_type for node in model.graph.node} == {"y": "Int5MatMul", "y2": "Int8MatMul"}
    tensors = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert tensors["w"].size == -(-n // 16) * 16 * k * 5 // 8 and tensors["s"].dtype == np.float16
    assert_first_output_is(library, path, q5_0_weight(values, scales))


def test_int8_nodes_with_minimums_run_in_five_bits_or_are_refused(library, tmp_path):
    """`use_in_graph` on our Int8MatMul nodes with minimums, as the build exports Q5_1 / Q5_K linears: each becomes
    an Int5MatMul node of the values as they are (no offset), Q5_1's scales and minimums float16 as the file, Q5_K's
    factored (uint8 multipliers, float16 factors), computing its float64 reference; a node whose values exceed 5
    bits is an error (no kernel takes int8 minimums)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    n, k = 37, 512
    q5_1, q5_k = q5_1_blocks(n, k, seed=6), q5_k_blocks(n, k, seed=7)
    constants = {}
    for suffix, (values, scales, minimums) in (("", q5_1), ("2", q5_k)):
        constants |= {f"w{suffix}": values.reshape(n, -1, 32), f"s{suffix}": scales.astype(np.float32).reshape(-1)}
        constants[f"m{suffix}"] = minimums
    nodes = [
        helper.make_node("Int8MatMul", ["a", *inputs], [out], domain=DOMAIN, K=k, N=n, block_size=32, name=out)
        for inputs, out in ((["w", "s", "m"], "y"), (["w2", "s2", "m2"], "y2"))
    ]
    path = save_two_nodes(tmp_path / "two.onnx", nodes, constants, k)
    counts = int4_matmul.use_in_graph(path)
    assert (counts["Int5MatMul"], counts["Int8MatMul"]) == (2, 0)
    model = onnx.load(str(path))
    assert {node.name: (node.op_type, len(node.input)) for node in model.graph.node} == {
        "y": ("Int5MatMul", 4),
        "y2": ("Int5MatMul", 5),
    }
    types = {t.name: t.data_type for t in model.graph.initializer}
    assert (types["s"], types["m"]) == (TensorProto.FLOAT16, TensorProto.FLOAT16)
    assert (types["s2"], types["m2"], types["s2/factors"]) == (
        TensorProto.UINT8,
        TensorProto.UINT8,
        TensorProto.FLOAT16,
    )
    tensors = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert tensors["w"].size == tensors["w2"].size == -(-n // 16) * 16 * k * 5 // 8
    assert_first_output_is(library, path, with_minimums_weight(*q5_1))
    assert_first_output_is(library, path, with_minimums_weight(*q5_k), output=1)

    values, scales, minimums = q5_1
    wide = values.copy()
    wide[3, 40] = 32  # beyond 5 bits
    constants = {"w": wide.reshape(n, -1, 32), "s": scales.astype(np.float32).reshape(-1), "m": minimums}
    constants |= {"w2": constants["w"].copy(), "s2": constants["s"].copy(), "m2": minimums.copy()}
    path = save_two_nodes(tmp_path / "wide.onnx", nodes, constants, k)
    with pytest.raises(ValueError, match="beyond 5 bits"):
        int4_matmul.use_in_graph(path)


def rows_session(library: Path, tiled: list[np.ndarray], k: int, n: int, bits: int, block: int):
    """A session of one QuantizedRows node reading `tiled` (a matmul node's inputs as the build stores them)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    names = [f"input{i}" for i in range(len(tiled))]
    node = helper.make_node(
        "QuantizedRows",
        ["ids", *names],
        ["rows"],
        domain=DOMAIN,
        K=k,
        N=n,
        bits=bits,
        block_size=block,
        column_tile=int4_matmul.COLUMN_TILE,
    )
    graph = helper.make_graph(
        [node],
        "rows",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "tokens"])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["batch", "tokens", k])],
        [numpy_helper.from_array(array, name) for name, array in zip(names, tiled)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def rows_case(kind: str, n: int, k: int):
    """(the node's inputs as the build tiles them, bits, block, the reference's blocks: MatMulNBits-layout weights,
    float32 scales, minimums or None) for one storage form of a head."""
    tile = lambda values: int4_matmul.tile_per_block(values, n)  # noqa: E731
    if kind == "Q6_K":
        values, multipliers, factors = q6_k_blocks(n, k, seed=3)
        stored = (values.astype(np.int16) + 96).astype(np.uint8).reshape(n, -1, 16)
        scales = np.repeat(factors.astype(np.float32), 16, -1) * multipliers
        tiled = [int4_matmul.tile_weights(int4_matmul.six_bit_bytes(values), 6), tile(multipliers), tile(factors)]
        return tiled, 6, 16, (stored, scales, None)
    if kind == "Q4_K":
        (packed, multipliers, minimum_multipliers, factors), (scales, minimums) = factored_q4_k(n, k, seed=3)
        tiled = [int4_matmul.tile_weights(packed, 4), tile(multipliers), tile(minimum_multipliers), tile(factors)]
        return tiled, 4, 32, (packed, scales, minimums)
    if kind == "Q5_1":
        values, scales, minimums = q5_1_blocks(n, k, seed=3)
        tiled = [int4_matmul.tile_weights(int4_matmul.five_bit_bytes(values), 5), tile(scales), tile(minimums)]
        return tiled, 5, 32, (values.reshape(n, -1, 32), scales.astype(np.float32), minimums)
    if kind == "Q5_K":
        values, scales, minimums = q5_k_blocks(n, k, seed=3)
        (multipliers, scale_factors), (minimum_multipliers, minimum_factors) = (
            int4_matmul.factored_scales(v) for v in (scales, minimums)
        )
        factors = np.stack((scale_factors, minimum_factors), -1).reshape(n, -1)
        bytes_ = int4_matmul.five_bit_bytes(values)
        tiled = [int4_matmul.tile_weights(bytes_, 5), tile(multipliers), tile(minimum_multipliers), tile(factors)]
        return tiled, 5, 32, (values.reshape(n, -1, 32), scales, minimums)
    if kind == "Q5_0":
        values, scales = q5_0_blocks(n, k, seed=3)
        stored = (values.astype(np.int16) + 112).astype(np.uint8).reshape(n, -1, 32)
        tiled = [int4_matmul.tile_weights(int4_matmul.five_bit_bytes(values), 5), tile(scales)]
        return tiled, 5, 32, (stored, scales.astype(np.float32), None)
    if kind == "Q8_0":
        packed = np.random.default_rng(3).integers(0, 256, (n, k // 32, 32), dtype=np.uint8)
        scales = (np.random.default_rng(4).random(n * k // 32) * 0.02).astype(np.float16)
        return [int4_matmul.tile_weights(packed, 8), tile(scales)], 8, 32, (packed, scales.astype(np.float32), None)
    block = 128 if kind == "int4 g128" else 32
    packed, scales, minimums = q4_1_blocks(n, k, seed=3)
    if kind != "Q4_1":
        packed, scales = weights(n, k, block, seed=3)
        minimums = None
    scales = scales.astype(np.float16) if kind != "int4 g128" else scales  # as the build stores int4 scales
    tiled = [int4_matmul.tile_weights(packed, 4), tile(scales)] + ([] if minimums is None else [tile(minimums)])
    return tiled, 4, block, (packed, scales.astype(np.float32), minimums)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "int4 g128"])
def test_rows_of_a_heads_tiles_are_the_references_rows_bit_for_bit(library, kind):
    """QuantizedRows, the embedding lookup of a tied head: from the head's node's inputs as the build stores them
    (column tiles; float16, factored or 6-bit), each row what plugins/quant_linear.py's reference dequantizes from
    the blocks in MatMulNBits's layout, bit for bit."""
    import torch

    from plugins.quant_linear import dequantized_rows

    n, k = 37, 512
    tiled, bits, block, (packed, scales, minimums) = rows_case(kind, n, k)
    ids = np.array([[0, 36, 5], [16, 15, 17]], np.int64)
    ours = rows_session(library, tiled, k, n, bits, block).run(None, {"ids": ids})[0]
    reference = dequantized_rows(
        torch.from_numpy(ids),
        torch.from_numpy(packed),
        torch.from_numpy(np.ascontiguousarray(scales).reshape(-1)),
        None if minimums is None else torch.from_numpy(minimums),
        k,
        8 if bits in (5, 6) else bits,  # the reference holds 5- and 6-bit values as int8 blocks
    )
    assert ours.shape == (2, 3, k)
    np.testing.assert_array_equal(ours, reference.numpy())


def test_rows_refuse_an_id_outside_the_table_and_inputs_of_another_form(library):
    import onnxruntime as ort

    n, k = 37, 512
    tiled, bits, block, _ = rows_case("Q6_K", n, k)
    state = ort.capi.onnxruntime_pybind11_state
    with pytest.raises(state.Fail, match="outside the table"):
        rows_session(library, tiled, k, n, bits, block).run(None, {"ids": np.array([[n]], np.int64)})
    with pytest.raises(state.Fail, match="not a quantized matmul's"):
        rows_session(library, tiled[:2] + [tiled[2][:-1]], k, n, bits, block).run(
            None, {"ids": np.zeros((1, 1), np.int64)}
        )
    with pytest.raises(state.RuntimeException, match="block_size"):
        rows_session(library, tiled, k, n, bits, 32).run(None, {"ids": np.zeros((1, 1), np.int64)})


def test_covers_says_which_heads_our_kernels_run():
    """The build exports a tied head's lookup as QuantizedRows only where the head's node becomes one of ours."""
    from plugins.quant_linear import QuantSpec

    n, k = 16, 256
    values, multipliers, factors = q6_k_blocks(n, k)
    stored = (values.astype(np.int16) + 96).astype(np.uint8).reshape(n, -1, 16)
    scales = (np.repeat(factors.astype(np.float32), 16, -1) * multipliers).reshape(-1)
    rtn = np.random.default_rng(1).integers(0, 256, stored.shape, dtype=np.uint8)
    assert int4_matmul.covers(QuantSpec(4, 32), k, stored, scales)
    assert int4_matmul.covers(QuantSpec(4, 32, minimums=True), k, stored, scales)
    assert not int4_matmul.covers(QuantSpec(4, 64, minimums=True), k, stored, scales)  # an offset matmul beside
    assert not int4_matmul.covers(QuantSpec(4, 32, accuracy_level=0), k, stored, scales)
    assert int4_matmul.covers(QuantSpec(8, 16), k, stored, scales)  # Q6_K's blocks: Int6MatMul
    assert not int4_matmul.covers(QuantSpec(8, 16), k, rtn, scales)  # 8-bit values: MatMulNBits
    five_bit = np.random.default_rng(2).integers(0, 32, (n, k // 32, 32), dtype=np.uint8)
    assert int4_matmul.covers(QuantSpec(8, 32, minimums=True), k, five_bit, scales)  # Q5_1 / Q5_K: Int5MatMul
    assert not int4_matmul.covers(QuantSpec(8, 32, minimums=True), k, rtn.reshape(n, -1, 32), scales)
    assert not int4_matmul.covers(QuantSpec(8, 32, minimums=True, accuracy_level=0), k, five_bit, scales)
