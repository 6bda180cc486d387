"""Weight-only quantized linear: int4 / int8 blocks along the input dimension, one fp32 scale per block,
symmetric (zero point 2^(bits-1), as onnxruntime assumes when none is given): w = scale * (q - 2^(bits-1)); or with
one minimum per block besides the scale: w = scale * q + minimum, llama.cpp's Q4_1 / Q5_1 block as it is (float16
minimums) or a Q4_K / Q5_K sub-block (float32 minimums: its scale and minimum are products of a float16 and a 6-bit
integer); the 5-bit values as int8 blocks.

One op, in one place:
- `quantize_blockwise` packs a float weight [N, K] into onnxruntime's MatMulNBits layout: uint8
  [N, ceil(K / block), block * bits / 8] (int4: two values per byte, low nibble first) and scales [N * blocks];
- `torch.ops.plugins.matmul_nbits`: the reference (unpack, dequantize, matmul in fp32) used for eager runs and
  tests, and a fake kernel for torch.export;
- `ONNX_TRANSLATIONS`: its lowering to com.microsoft::MatMulNBits, the fused quantized matmul onnxruntime runs
  natively; the exported graph never holds a float copy of the weight.
Rows (output features) are quantized independently, so a fused weight can be quantized slice by slice as the
checkpoint streams by.

Minimums are not a MatMulNBits input (its float zero points would express them only after a division, inexactly,
and onnxruntime runs those on a path far slower at batch 1: docs/measurements.md). Linears with minimums export
instead as our own kernel's node with its optional minimums input (plugins/int4_matmul.c), `Int4MatMul` for int4
blocks and `Int8MatMul` for int8 ones whose values fit 5 bits (which the graph stage stores in 5 bits, as
`Int5MatMul`), through `torch.ops.plugins.minimums_matmul`, when the build uses those kernels (`native_minimums`).
Without them they export as MatMulNBits plus sum_b(x over block b) @ (minimum + 2^(bits-1) scale)[:, b], an
[M, K/block] x [K/block, N] float matmul next to the fused one: the same weights, more nodes, slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plugins.int4_matmul import OPS as KERNEL_OPS_BY_BITS  # our node for blocks with minimums (int8: 5-bit values)
from plugins.native_ops import DOMAIN
from plugins.onnx_schema import register_contrib_op

SUPPORTED_BITS = (4, 8)
SUPPORTED_BLOCKS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    block_size: int
    # onnxruntime's accuracy_level: 4 quantizes activations to int8 on the fly and uses integer dot products
    # (several times faster on CPU, activation rounding ~1e-2 relative); 0 computes in fp32.
    accuracy_level: int = 4
    minimums: bool = False  # one minimum per block besides the scale (Q4_1 blocks): w = scale * q + min
    # what the minimums are stored as: float16 holds Q4_1's as the file does, float32 Q4_K's products dmin x m
    minimum_dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.block_size not in SUPPORTED_BLOCKS:
            raise ValueError(f"group size must be one of {SUPPORTED_BLOCKS}, got {self.block_size}")
        if self.accuracy_level not in (0, 4):
            raise ValueError("accuracy_level must be 0 (fp32 compute) or 4 (int8 compute)")
        if self.minimum_dtype not in ("float16", "float32"):
            raise ValueError(f"minimums are float16 or float32, not {self.minimum_dtype}")


def blocks(in_features: int, block_size: int) -> int:
    return -(-in_features // block_size)


def pack_values(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [N, blocks, block] -> MatMulNBits bytes (int4: two per byte, low nibble first)."""
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q.contiguous()


def quantize_blockwise(weight: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric quantization of `weight` [N, K] -> (packed uint8, fp32 scales)."""
    out_features, in_features = weight.shape
    n_blocks = blocks(in_features, block_size)
    padded = torch.zeros(out_features, n_blocks * block_size, dtype=torch.float32)
    padded[:, :in_features] = weight.float()
    grouped = padded.view(out_features, n_blocks, block_size)
    zero, qmax = 1 << (bits - 1), (1 << (bits - 1)) - 1
    if bits == 4:
        # llama.cpp's Q4_0 rule: the block's value of largest magnitude, sign kept, lands exactly on the lowest code
        # -8, so all 16 levels are in use (max|w| / 7 leaves one unused: perplexity 14.8 against 13.7 for int4 g32 on
        # the default model); the scale is negative where that value is positive
        extreme = grouped.gather(-1, grouped.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        scales = extreme / -zero
    else:
        # int8 stays in [-127, 127]: the same rule (codes down to -128) took the int8 engine's perplexity from
        # 10.267 to 10.376 in onnxruntime while the eager reference stayed at fp32's (its integer kernel's doing,
        # not the grid's), and one level in 256 is worth nothing
        scales = grouped.abs().amax(dim=-1) / qmax
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = (torch.round(grouped / scales.unsqueeze(-1)).clamp(-zero, qmax) + zero).to(torch.uint8)
    return pack_values(q, bits), scales.reshape(-1).contiguous()


def dequantize_blockwise(
    qweight: torch.Tensor, scales: torch.Tensor, in_features: int, bits: int, minimums: torch.Tensor | None = None
) -> torch.Tensor:
    """The float weight [N, in_features] (fp32) the blocks hold: scale * (q - zero point), or scale * q + minimum
    where there are minimums."""
    out_features, n_blocks, _ = qweight.shape
    if bits == 4:
        # nibbles by integer arithmetic on int32: traced into a graph (the embedding read from a head's blocks) a
        # shift of uint8 comes out as a mix of uint8 and int8 that onnxruntime refuses
        wide = qweight.to(torch.int32)
        high = torch.div(wide, 16, rounding_mode="floor")
        q = torch.stack((wide - 16 * high, high), dim=-1).reshape(out_features, n_blocks, -1)
    else:
        q = qweight
    if minimums is None:
        weight = (q.float() - (1 << (bits - 1))) * scales.view(out_features, n_blocks, 1)
    else:
        weight = q.float() * scales.view(out_features, n_blocks, 1) + minimums.float().view(out_features, n_blocks, 1)
    return weight.reshape(out_features, -1)[:, :in_features]


def dequantize_matmul(x, qweight, scales, minimums, in_features: int, bits: int) -> torch.Tensor:
    """The reference of every quantized matmul op: x [..., K] @ dequantize_blockwise(...).T in fp32, returned in
    x's dtype."""
    return (x.float() @ dequantize_blockwise(qweight, scales, in_features, bits, minimums).t()).to(x.dtype)


@torch.library.custom_op("plugins::matmul_nbits", mutates_args=())
def matmul_nbits(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    in_features: int,
    out_features: int,
    bits: int,
    block_size: int,
    accuracy_level: int,
) -> torch.Tensor:
    """Reference: dequantize to fp32 and matmul (eager runs and tests only; the engine runs MatMulNBits)."""
    return dequantize_matmul(x, qweight, scales, None, in_features, bits)


@matmul_nbits.register_fake
def _(x, qweight, scales, in_features, out_features, bits, block_size, accuracy_level):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("plugins::minimums_matmul", mutates_args=())
def minimums_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    minimums: torch.Tensor,
    in_features: int,
    out_features: int,
    bits: int,
    block_size: int,
) -> torch.Tensor:
    """Reference of our Int4MatMul / Int8MatMul node with minimums (w = scale * q + minimum): dequantize to fp32 and
    matmul. The node itself quantizes activations to int8 per 32, as MatMulNBits's accuracy_level 4 does."""
    return dequantize_matmul(x, qweight, scales, minimums, in_features, bits)


@minimums_matmul.register_fake
def _(x, qweight, scales, minimums, in_features, out_features, bits, block_size):
    return x.new_empty(*x.shape[:-1], out_features)


def dequantized_rows(
    ids: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    minimums: torch.Tensor | None,
    in_features: int,
    bits: int,
) -> torch.Tensor:
    """Rows `ids` [...] of blocks in MatMulNBits's layout (flat scales, minimums [N, blocks]), dequantized to fp32
    [..., in_features] as `dequantize_blockwise` computes them."""
    n_blocks = qweight.shape[1]
    flat = ids.reshape(-1)
    picked = None if minimums is None else minimums.index_select(0, flat)
    # indices into the flat scales the matmul reads too (a reshaped view would be stored again as a constant)
    scale_index = (flat.unsqueeze(-1) * n_blocks + torch.arange(n_blocks, device=flat.device)).reshape(-1)
    rows = dequantize_blockwise(
        qweight.index_select(0, flat), scales.index_select(0, scale_index), in_features, bits, picked
    )
    return rows.reshape(*ids.shape, in_features)


@torch.library.custom_op("plugins::quantized_rows", mutates_args=())
def quantized_rows(
    ids: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    minimums: torch.Tensor | None,
    in_features: int,
    out_features: int,
    bits: int,
    block_size: int,
) -> torch.Tensor:
    """Reference of our QuantizedRows node (plugins/int4_matmul.c), which reads the rows from the head's matmul
    node's own inputs, in whatever form the build stores them for that node."""
    return dequantized_rows(ids, qweight, scales, minimums, in_features, bits)


@quantized_rows.register_fake
def _(ids, qweight, scales, minimums, in_features, out_features, bits, block_size):
    return ids.new_empty(*ids.shape, in_features, dtype=torch.float32)


class QuantizedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, spec: QuantSpec) -> None:
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        n_blocks = blocks(in_features, spec.block_size)
        self.register_buffer(
            "qweight", torch.zeros(out_features, n_blocks, spec.block_size * spec.bits // 8, dtype=torch.uint8)
        )
        self.register_buffer("scales", torch.zeros(out_features * n_blocks, dtype=torch.float32))
        if spec.minimums:
            if in_features % spec.block_size:
                raise ValueError(f"block minimums need in_features ({in_features}) to be a multiple of the block size")
            dtype_of_minimums = getattr(torch, spec.minimum_dtype)
            self.register_buffer("minimums", torch.zeros(out_features, n_blocks, dtype=dtype_of_minimums))
        else:
            self.minimums = None
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        # the torch backends' op (plugins/blockwise_matmul.py: one Triton kernel, minimums inside) instead of
        # matmul_nbits plus a minimum matmul, which the ONNX engines lower to onnxruntime's MatMulNBits
        self.fused_kernel = False
        # blocks with minimums (and int8 activations) as our Int4MatMul / Int8MatMul node, minimums inside it
        self.native_minimums = False
        # `rows` as our QuantizedRows node, which reads this linear's blocks where our matmul node reads them
        self.native_rows = False

    def load_rows(self, start: int, weight: torch.Tensor) -> None:
        """Quantize checkpoint rows [start, start + len(weight)) into place (fused weights arrive in slices)."""
        self.load_quantized_rows(start, *quantize_blockwise(weight, self.spec.bits, self.spec.block_size))

    def load_quantized_rows(
        self, start: int, qweight: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None = None
    ) -> None:
        """Rows already in this layout (e.g. GGUF blocks). In a linear with minimums, symmetric rows (Q4_0 beside
        Q4_1 in one fused weight) take minimum = -zero point x scale, which must be exact in the minimums' type."""
        rows, n_blocks = qweight.shape[0], blocks(self.in_features, self.spec.block_size)
        if minimums is not None and self.minimums is None:
            raise ValueError("these rows carry block minimums but the linear was built without them")
        if minimums is None and self.minimums is not None:
            symmetric = -float(1 << (self.spec.bits - 1)) * scales.float().view(rows, n_blocks)
            minimums = symmetric.to(self.minimums.dtype)
            if not torch.equal(minimums.float(), symmetric):
                where = f"-zero point x scale is {self.minimums.dtype}"
                raise ValueError(f"symmetric rows join a linear with minimums only where {where}")
        # (stored as MatMulNBits has them, or by row: QuantizedEmbedding)
        self.qweight[start : start + rows] = qweight.reshape(rows, *self.qweight.shape[1:])
        self.scales.view(-1)[start * n_blocks : (start + rows) * n_blocks] = scales
        if self.minimums is not None:
            self.minimums[start : start + rows] = minimums

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [...] of the weight, dequantized to fp32 [..., in_features]: a tied LM head's blocks read as
        the embedding table, as llama.cpp reads a GGUF's quantized token_embd and onnxruntime-genai its int4 head, so
        no float copy of the table exists."""
        s = self.spec
        if self.native_rows:
            return torch.ops.plugins.quantized_rows(
                ids, self.qweight, self.scales, self.minimums, self.in_features, self.out_features, s.bits, s.block_size
            )
        return dequantized_rows(ids, self.qweight, self.scales, self.minimums, self.in_features, s.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if self.fused_kernel:
            from plugins.blockwise_matmul import quantized_linear

            y = quantized_linear(
                x, self.qweight, self.scales, self.minimums, self.in_features, self.out_features, s.bits, s.block_size
            )
            return y if self.bias is None else y + self.bias
        if self.minimums is not None and self.native_minimums:
            y = torch.ops.plugins.minimums_matmul(
                x, self.qweight, self.scales, self.minimums, self.in_features, self.out_features, s.bits, s.block_size
            )
            return y if self.bias is None else y + self.bias
        y = torch.ops.plugins.matmul_nbits(
            x, self.qweight, self.scales, self.in_features, self.out_features, s.bits, s.block_size, s.accuracy_level
        )
        if self.minimums is not None:
            # matmul_nbits computed scale * (q - zero point); the blocks hold scale * q + minimum
            n_blocks = self.qweight.shape[1]
            offsets = self.minimums.float() + (1 << (s.bits - 1)) * self.scales.view(-1, n_blocks)
            block_sums = x.float().unflatten(-1, (n_blocks, s.block_size)).sum(-1)
            y = y + (block_sums @ offsets.t()).to(y.dtype)
        return y if self.bias is None else y + self.bias


class QuantizedEmbedding(QuantizedLinear):
    """A token embedding table [vocab, hidden] held in a quantized linear's blocks and read by rows: a lookup
    dequantizes only the rows of the call's tokens, as llama.cpp reads a GGUF's quantized token_embd, so no float
    copy of the table exists. Loaded as a linear with `out_features` = vocab (`load_rows`, `load_quantized_rows`);
    it is never multiplied."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, spec: QuantSpec) -> None:
        super().__init__(embedding_dim, num_embeddings, False, dtype, spec)
        self.dtype = dtype
        # by row, as the lookup gathers them: [vocab, blocks x bytes] and [vocab, blocks]
        self.register_buffer("qweight", self.qweight.view(num_embeddings, -1))
        self.register_buffer("scales", self.scales.view(num_embeddings, -1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [...] of the table, [..., embedding_dim] in the model's dtype: scale x (q - zero point), or
        scale x q + minimum, computed as `dequantize_blockwise` computes them."""
        codes = F.embedding(ids, self.qweight).to(torch.int64)  # [..., blocks x bytes]
        values = F.embedding(codes, self.byte_values()).reshape(*ids.shape, self.scales.shape[1], -1)
        weight = values * F.embedding(ids, self.scales).unsqueeze(-1)  # [..., blocks, block]
        if self.minimums is not None:
            weight = weight + F.embedding(ids, self.minimums).float().unsqueeze(-1)
        return weight.flatten(-2)[..., : self.in_features].to(self.dtype)

    def byte_values(self) -> torch.Tensor:
        """[256, values a byte holds]: each byte's values less the zero point, looked up rather than unpacked (the
        export folds the table into a constant): unpacking nibbles by integer ops took some twenty nodes a lookup,
        ~5% of an untied int4 model's decode step."""
        codes = torch.arange(256, device=self.qweight.device)
        values = torch.stack((codes % 16, codes // 16), -1) if self.spec.bits == 4 else codes.unsqueeze(-1)
        return (values - (0 if self.spec.minimums else 1 << (self.spec.bits - 1))).float()

    def stored_bytes(self) -> int:
        """The table's bytes as the graph stores it (blocks, scales and minimums)."""
        return sum(
            buffer.numel() * buffer.element_size()
            for buffer in (self.qweight, self.scales, self.minimums)
            if buffer is not None
        )


def _register_schema() -> None:
    register_contrib_op(
        "MatMulNBits",
        inputs=["A:T1", "B:T2", "scales:T1"],
        outputs=["Y:T1"],
        types={"T1": ["tensor(float)", "tensor(float16)"], "T2": ["tensor(uint8)"]},
        attributes={name: int for name in ("K", "N", "bits", "block_size", "accuracy_level")},
    )
    for op in KERNEL_OPS_BY_BITS.values():
        register_contrib_op(
            op,
            inputs=["A:T1", "B:T2", "scales:T1", "minimums?:T3"],
            outputs=["Y:T1"],
            types={"T1": ["tensor(float)"], "T2": ["tensor(uint8)"], "T3": ["tensor(float16)", "tensor(float)"]},
            attributes={name: int for name in ("K", "N", "block_size")},
            domain=DOMAIN,
        )
    register_contrib_op(
        "QuantizedRows",
        inputs=["ids:T0", "B:T2", "scales:T1", "minimums?:T3"],
        outputs=["Y:T1"],
        types={
            "T0": ["tensor(int64)"],
            "T1": ["tensor(float)"],
            "T2": ["tensor(uint8)"],
            "T3": ["tensor(float16)", "tensor(float)"],
        },
        attributes={name: int for name in ("K", "N", "bits", "block_size")},
        domain=DOMAIN,
    )


def onnx_translations() -> dict:
    """custom_translation_table entries for torch.onnx.export."""
    import onnxscript

    _register_schema()
    microsoft = onnxscript.values.Opset("com.microsoft", 1)
    ours = onnxscript.values.Opset(DOMAIN, 1)

    def matmul_nbits_to_onnx(
        x, qweight, scales, in_features: int, out_features: int, bits: int, block_size: int, accuracy_level: int
    ):
        return microsoft.MatMulNBits(
            x,
            qweight,
            scales,
            K=in_features,
            N=out_features,
            bits=bits,
            block_size=block_size,
            accuracy_level=accuracy_level,
        )

    def minimums_matmul_to_onnx(
        x, qweight, scales, minimums, in_features: int, out_features: int, bits: int, block_size: int
    ):
        op = getattr(ours, KERNEL_OPS_BY_BITS[bits])
        return op(x, qweight, scales, minimums, K=in_features, N=out_features, block_size=block_size)

    def quantized_rows_to_onnx(
        ids, qweight, scales, minimums, in_features: int, out_features: int, bits: int, block_size: int
    ):
        inputs = [ids, qweight, scales] + ([] if minimums is None else [minimums])
        return ours.QuantizedRows(*inputs, K=in_features, N=out_features, bits=bits, block_size=block_size)

    return {
        torch.ops.plugins.matmul_nbits.default: matmul_nbits_to_onnx,
        torch.ops.plugins.minimums_matmul.default: minimums_matmul_to_onnx,
        torch.ops.plugins.quantized_rows.default: quantized_rows_to_onnx,
    }
