"""Weight-only quantized matmul for the torch backends (AOTInductor, TensorRT): one Triton kernel over our block
formats, int4 and int8, symmetric or with a per-block minimum, for fp32 / fp16 / bf16 activations.

The weight layout is the one the ONNX engines use (plugins/quant_linear.py): uint8 [N, blocks, block * bits / 8]
(int4: two values per byte, low nibble first), fp32 scales [N * blocks], and optionally float16 minimums [N, blocks]:
    w[n, k] = scale[n, b] * (q[n, k] - 2^(bits-1))       without minimums,   b = k // block
    w[n, k] = scale[n, b] * q[n, k] + minimum[n, b]       with them,
which holds llama.cpp's Q4_0 / Q8_0 blocks (no minimum) and Q4_1 blocks (its scale and minimum) exactly. The
minimum is applied inside the kernel, where the block is unpacked: no second matmul, no float copy of the weight.

One op, in one place:
- `torch.ops.plugins.blockwise_matmul`: a `torch.library.triton_op`. On CUDA tensors it launches the Triton kernel
  (`run_kernel`), which AOTInductor compiles into its package. On CPU tensors it runs `dequantize_matmul`, the
  float reference: unpack, dequantize, matmul, which is also what AOTInductor compiles for a CPU engine (a float
  GEMM after an in-graph dequantization, not a fused kernel; the build log and the manifest say so). The tests
  run the kernel itself on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
  imported) against an independent float64 reference.
- `TILES`: the kernel's tile for a call of M rows. Rows share the weight stream: a program unpacks each weight
  block once for its BLOCK_M rows. Decode and verify calls (M <= SMALL_M) take narrow column tiles, so that a
  one-row call still spreads over every multiprocessor; prompt chunks take wide ones. `quantized_linear` picks the
  tile with a `torch.cond` on the row count, which the exported graph keeps as a runtime branch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from plugins.quant_linear import dequantize_matmul

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engines need no Triton; the op then runs its reference on CPU and refuses CUDA
    triton = None

SMALL_M = 16  # the most rows a call takes the decode tile for
MIN_INT4_BLOCK = 32  # tl.dot wants 16 or more along K: half an int4 block per product


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    num_warps: int


TILES = (Tile(16, 32, 4), Tile(64, 128, 8))  # index 0: M <= SMALL_M (decode, verify); 1: prompt chunks


def tile_index(rows: int) -> int:
    return 0 if rows <= SMALL_M else 1


def unavailable_reason(device: str) -> str | None:
    """Why the Triton kernel cannot run on `device` here, or None."""
    if triton is None:
        return "Triton is not installed (pip install triton)"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton runs on CPU only in its interpreter (TRITON_INTERPRET=1 before Triton is imported)"
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    return None


if triton is not None:

    @triton.jit
    def _blockwise_matmul_kernel(
        x_ptr,
        w_ptr,
        scale_ptr,
        minimum_ptr,
        out_ptr,
        M,
        N,
        K,
        n_blocks,
        BITS: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_MINIMUMS: tl.constexpr,
        FP32: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """out[M, N] = x[M, K] @ w[N, K].T, one quantization block of K per iteration: the block's bytes are loaded
        and unpacked once for the program's BLOCK_M rows, then multiplied on the tensor cores (tl.dot) in fp32
        accumulation. int4: the even and odd K positions (low and high nibbles) are two half-block products, so no
        nibble is ever interleaved."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        zero = 0 if HAS_MINIMUMS else 1 << (BITS - 1)
        row_bytes = n_blocks * (BLOCK * BITS // 8)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for b in range(0, n_blocks):
            scale = tl.load(scale_ptr + cols * n_blocks + b, mask=col_ok, other=0.0)[:, None]
            if HAS_MINIMUMS:  # scale * q + minimum: no zero point
                minimum = tl.load(minimum_ptr + cols * n_blocks + b, mask=col_ok, other=0.0).to(tl.float32)[:, None]
            else:
                minimum = 0.0
            if BITS == 4:
                j = tl.arange(0, BLOCK // 2)
                packed = tl.load(
                    w_ptr + cols[:, None] * row_bytes + b * (BLOCK // 2) + j[None, :], mask=col_ok[:, None], other=0
                )
                even_k = b * BLOCK + 2 * j
                x_even = tl.load(
                    x_ptr + rows[:, None] * K + even_k[None, :], mask=row_ok[:, None] & (even_k < K)[None, :], other=0.0
                )
                x_odd = tl.load(
                    x_ptr + rows[:, None] * K + even_k[None, :] + 1,
                    mask=row_ok[:, None] & (even_k + 1 < K)[None, :],
                    other=0.0,
                )
                w_even = ((packed & 0x0F).to(tl.float32) - zero) * scale + minimum
                w_odd = ((packed >> 4).to(tl.float32) - zero) * scale + minimum
                if FP32:
                    acc += tl.dot(x_even, tl.trans(w_even), input_precision="ieee")
                    acc += tl.dot(x_odd, tl.trans(w_odd), input_precision="ieee")
                else:
                    acc += tl.dot(x_even, tl.trans(w_even.to(x_even.dtype)))
                    acc += tl.dot(x_odd, tl.trans(w_odd.to(x_odd.dtype)))
            else:
                j = tl.arange(0, BLOCK)
                q = tl.load(w_ptr + cols[:, None] * row_bytes + b * BLOCK + j[None, :], mask=col_ok[:, None], other=0)
                k = b * BLOCK + j
                x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
                w = (q.to(tl.float32) - zero) * scale + minimum
                if FP32:
                    acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        out = out_ptr + rows[:, None] * N + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def run_kernel(x, qweight, scales, minimums, in_features, out_features, bits, block_size, tile: int) -> torch.Tensor:
    """The Triton kernel on x [..., in_features] -> [..., out_features] in x's dtype."""
    reason = unavailable_reason(x.device.type)
    if reason is not None:
        raise RuntimeError(f"the Triton blockwise matmul cannot run on {x.device}: {reason}")
    if bits == 4 and block_size < MIN_INT4_BLOCK:
        raise ValueError(f"the Triton kernel takes int4 blocks of {MIN_INT4_BLOCK} or more, not {block_size}")
    x2d = x.reshape(-1, in_features).contiguous()
    out = _launch(x2d, qweight, scales, minimums, in_features, out_features, bits, block_size, TILES[tile])
    return out.reshape(*x.shape[:-1], out_features)


def _launch(x2d, qweight, scales, minimums, in_features, out_features, bits, block_size, tile: Tile) -> torch.Tensor:
    from torch.library import wrap_triton

    rows = x2d.shape[0]
    out = torch.empty(rows, out_features, dtype=x2d.dtype, device=x2d.device)
    grid = (triton.cdiv(rows, tile.block_m), triton.cdiv(out_features, tile.block_n))
    wrap_triton(_blockwise_matmul_kernel)[grid](
        x2d,
        qweight,
        scales,
        scales if minimums is None else minimums,  # not read without minimums
        out,
        rows,
        out_features,
        in_features,
        qweight.shape[1],
        BITS=bits,
        BLOCK=block_size,
        HAS_MINIMUMS=minimums is not None,
        FP32=x2d.dtype == torch.float32,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        num_warps=tile.num_warps,
    )
    return out


@torch.library.triton_op("plugins::blockwise_matmul", mutates_args=())
def blockwise_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    minimums: torch.Tensor | None,
    in_features: int,
    out_features: int,
    bits: int,
    block_size: int,
    tile: int,
) -> torch.Tensor:
    """x [..., in_features] @ the quantized weight's transpose -> [..., out_features] in x's dtype. `tile` indexes
    TILES (the kernel's tile; the reference ignores it)."""
    if x.device.type == "cpu":
        return dequantize_matmul(x, qweight, scales, minimums, in_features, bits)
    return run_kernel(x, qweight, scales, minimums, in_features, out_features, bits, block_size, tile)


def quantized_linear(
    x,
    qweight,
    scales,
    minimums,
    in_features: int,
    out_features: int,
    bits: int,
    block_size: int,
    tile_by_rows: bool | None = None,
):
    """The op with its tile chosen by the call's row count: a `torch.cond` the exported graph keeps, so one graph
    serves decode steps and prompt chunks. `tile_by_rows` defaults to "not on CPU", where the op is the reference
    and the tile means nothing (the tests set it to check the branch on CPU)."""

    def call(tile: int):
        def run(x, qweight, scales, *minimums):
            minimum = minimums[0] if minimums else None
            return blockwise_matmul(x, qweight, scales, minimum, in_features, out_features, bits, block_size, tile)

        return run

    operands = (x, qweight, scales) + (() if minimums is None else (minimums,))
    if not (x.device.type != "cpu" if tile_by_rows is None else tile_by_rows):
        return call(0)(*operands)
    rows = x.numel() // in_features
    return torch.cond(rows <= SMALL_M, call(0), call(1), operands)
