"""The Triton blockwise matmul (plugins/blockwise_matmul.py) against an independent float64 reference: on CPU in
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU), on CUDA where there is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plugins import blockwise_matmul
from plugins.quant_linear import QuantizedLinear, QuantSpec, dequantize_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    blockwise_matmul.unavailable_reason(DEVICE) is not None,
    reason=f"the Triton kernel cannot run here: {blockwise_matmul.unavailable_reason(DEVICE)}",
)


def random_blocks(rng, rows: int, in_features: int, bits: int, block: int, minimums: bool):
    """Codes, scales and minimums drawn at random, packed by hand (numpy) in the documented layout, and the float64
    weight they stand for, computed from the codes without the plugin's own unpacking."""
    n_blocks = -(-in_features // block)
    codes = rng.integers(0, 1 << bits, size=(rows, n_blocks, block), dtype=np.uint8)
    codes[:, -1, in_features - (n_blocks - 1) * block :] = 1 << (bits - 1)  # padding past K holds the zero code
    scales = rng.uniform(-0.05, 0.05, size=(rows, n_blocks)).astype(np.float32)
    mins = rng.uniform(-0.2, 0.2, size=(rows, n_blocks)).astype(np.float16) if minimums else None
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4) if bits == 4 else codes
    if minimums:  # scale * q + minimum
        weight = codes.astype(np.float64) * scales[..., None] + mins[..., None].astype(np.float64)
    else:
        weight = (codes.astype(np.float64) - (1 << (bits - 1))) * scales[..., None].astype(np.float64)
    weight = weight.reshape(rows, -1)[:, :in_features]
    tensors = (torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(scales.reshape(-1)))
    return (*tensors, None if mins is None else torch.from_numpy(mins)), weight


CASES = [
    # bits, block, rows M, N, K, minimums
    (4, 32, 1, 33, 96, False),
    (4, 32, 1, 64, 100, False),  # K not a multiple of the block
    (4, 32, 5, 17, 64, True),  # Q4_1-style blocks
    (4, 64, 16, 40, 128, True),
    (4, 32, 17, 31, 96, False),  # past SMALL_M: the prompt tile
    (8, 32, 3, 20, 80, False),
    (8, 16, 2, 9, 48, True),
    (8, 128, 33, 7, 256, False),
]


BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter computes bf16 tl.dot wrongly (3.9)"),
)


@pytest.mark.parametrize("bits,block,rows,out_features,in_features,minimums", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_kernel_matches_float64_reference(bits, block, rows, out_features, in_features, minimums, dtype):
    rng = np.random.default_rng(rows * 1000 + out_features)
    (qweight, scales, mins), weight = random_blocks(rng, out_features, in_features, bits, block, minimums)
    x = rng.standard_normal((rows, in_features)).astype(np.float32)
    x_in = torch.from_numpy(x).to(dtype)
    expected = x_in.double().numpy() @ weight.T
    tile = blockwise_matmul.tile_index(rows)
    args = [t if t is None else t.to(DEVICE) for t in (x_in, qweight, scales, mins)]
    got = blockwise_matmul.run_kernel(*args, in_features, out_features, bits, block, tile).cpu()
    assert got.dtype == dtype and got.shape == (rows, out_features)
    # fp16 / bf16: rounding of the activations' products and of the output
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got.double().numpy(), expected, atol=tolerance * scale, rtol=0)


@pytest.mark.parametrize("tile", range(len(blockwise_matmul.TILES)))
def test_every_tile_gives_each_row_the_same_result(tile):
    """A row's result does not depend on the tile or on the other rows of the call (batch invariance)."""
    rng = np.random.default_rng(7)
    (qweight, scales, mins), _ = random_blocks(rng, 24, 64, 4, 32, True)
    x = torch.from_numpy(rng.standard_normal((20, 64)).astype(np.float32)).to(DEVICE)
    args = (qweight.to(DEVICE), scales.to(DEVICE), mins.to(DEVICE), 64, 24, 4, 32)
    batched = blockwise_matmul.run_kernel(x, *args, tile)
    alone = blockwise_matmul.run_kernel(x[3:4], *args, 0)
    assert torch.equal(batched[3:4], alone)


def test_leading_axes_are_kept():
    rng = np.random.default_rng(3)
    (qweight, scales, _), weight = random_blocks(rng, 8, 32, 8, 32, False)
    x = torch.from_numpy(rng.standard_normal((2, 3, 32)).astype(np.float32))
    got = blockwise_matmul.run_kernel(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), None, 32, 8, 8, 32, 0)
    assert got.shape == (2, 3, 8)
    np.testing.assert_allclose(got.cpu().double().numpy(), x.double().numpy() @ weight.T, atol=1e-4)


def test_small_int4_blocks_are_refused():
    x, qweight, scales = torch.zeros(1, 32), torch.zeros(4, 2, 8, dtype=torch.uint8), torch.ones(8)
    with pytest.raises(ValueError, match="int4 blocks of 32 or more"):
        blockwise_matmul.run_kernel(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), None, 32, 4, 4, 16, 0)


def test_op_on_cpu_is_the_float_reference():
    """The registered op on CPU tensors computes dequantize-then-matmul, equal to QuantizedLinear's own path."""
    linear = QuantizedLinear(64, 24, False, torch.float32, QuantSpec(4, 32, 0, minimums=True))
    torch.manual_seed(0)
    linear.load_quantized_rows(0, *blockwise_matmul_inputs(linear))
    x = torch.randn(3, 64)
    got = torch.ops.plugins.blockwise_matmul(x, linear.qweight, linear.scales, linear.minimums, 64, 24, 4, 32, 0)
    torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)


def blockwise_matmul_inputs(linear):
    rows, n_blocks, width = linear.qweight.shape
    qweight = torch.randint(0, 256, (rows, n_blocks, width), dtype=torch.uint8)
    return qweight, torch.rand(rows * n_blocks) / 10, (torch.randn(rows, n_blocks) / 10).half()


@pytest.mark.parametrize("minimums", [False, True])
def test_the_tile_branch_survives_export_and_aot_compilation(tmp_path, minimums):
    """One exported graph for every row count: the torch.cond on rows is kept, and the compiled package gives the
    reference's result on both sides of SMALL_M (run on CPU, where both branches are the reference)."""
    rng = np.random.default_rng(5)
    (qweight, scales, mins), _ = random_blocks(rng, 24, 64, 4, 32, minimums)

    class Linear(torch.nn.Module):
        def forward(self, x):
            return blockwise_matmul.quantized_linear(x, qweight, scales, mins, 64, 24, 4, 32, tile_by_rows=True)

    rows = torch.export.Dim("rows", min=1, max=1024)
    example = torch.randn(3, 64)
    program = torch.export.export(Linear(), (example,), dynamic_shapes=({0: rows},))
    assert any(node.target is torch.ops.higher_order.cond for node in program.graph.nodes)
    package = torch._inductor.aoti_load_package(
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "linear.pt2"))
    )
    for count in (1, blockwise_matmul.SMALL_M, blockwise_matmul.SMALL_M + 1, 40):
        x = torch.randn(count, 64)
        expected = dequantize_matmul(x, qweight, scales, mins, 64, 4)
        torch.testing.assert_close(package(x), expected, rtol=1e-5, atol=1e-5)
