"""GGUF block-quantized weights, taken as they are into the engine's quantized linears where the formats agree.

llama.cpp's blocks hold consecutive inputs of one output row, fp16 scale first:
- Q8_0: d, 32 x int8 q                                       w = d * q
- Q5_0: d, 32 high bits, 16 bytes of low nibbles             w = d * (q - 16), q of 5 bits
- Q5_1: d, m, 32 high bits, 16 bytes of low nibbles          w = d * q + m, q of 5 bits
- Q4_0: d, 16 bytes (q[j] low nibble, q[j + 16] high nibble)  w = d * (q - 8)
- Q4_1: d, m, 16 bytes in the same nibble order               w = d * q + m
- Q4_K: a super-block of 256 inputs: d, dmin, 12 bytes of eight 6-bit scales sc and minimums m, 128 bytes whose 32
  bytes p hold sub-block 2p in their low nibbles and 2p + 1 in their high ones   w = (d * sc) * q - (dmin * m)
- Q5_K: Q4_K's super-block with 32 bytes of high bits after the scales: byte i's bit s is the fifth bit of input i
  of sub-block s                                                                  w = (d * sc) * q - (dmin * m)
- Q6_K: a super-block of 256 inputs: 128 bytes of low nibbles, 64 of high bit pairs, sixteen int8 scales sc (one
  per 16 inputs), d last                                                         w = (d * sc) * (q - 32), q of 6 bits
Our quantized linear (plugins/quant_linear.py) holds scale * (q - 2^(bits-1)), or scale * q + minimum with one
minimum per block, with 32-input blocks (16 for Q6_K), so all of them map without loss: the integers are repacked
(the 5-bit values of Q5_0, Q5_1 and Q5_K and Q6_K's 6-bit ones as int8), the fp16 scales widened (exactly), Q4_1's
and Q5_1's fp16 minimums kept as they are, and the K-quants' sub-block scales (and Q4_K's and Q5_K's minimums)
computed as llama.cpp computes them, in float32 (a float16 times an integer of at most 8 bits: exact there, not in
float16; our kernels' graph stores them factored again, plugins/int4_matmul.py's `factored_scales`, and the values
in 5 or 6 bits, `five_bit_nodes`, `six_bit_nodes`). Any other GGUF type (Q8_1, Q2_K, Q3_K, IQ*, ...) is dequantized
and requantized by the build.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from plugins.quant_linear import pack_values

BLOCK = 32


@dataclass(frozen=True)
class ExactForm:
    """The quantized-linear layout that holds a GGUF type's blocks as they are."""

    bits: int
    minimum_dtype: str | None = None  # the minimums' dtype where the blocks carry minimums
    block_size: int = BLOCK  # inputs per scale
    # whether an embedding table (or a tied head, which the table's lookups read) keeps them so: Q6_K's int8 blocks of
    # 16 with float32 scales are 10 bits a weight, compact only in the matmul kernel's own form (6.5625)
    in_tables: bool = True
    # the bits a value takes in our CPU kernels' own form where fewer than `bits` (plugins/int4_matmul.py stores int8
    # blocks whose values fit 5 or 6 bits so)
    packed_bits: int | None = None


EXACT_FORMS = {
    "Q8_0": ExactForm(8),
    "Q5_0": ExactForm(8, packed_bits=5),
    "Q5_1": ExactForm(8, "float16", packed_bits=5),
    "Q5_K": ExactForm(8, "float32", packed_bits=5),
    "Q4_0": ExactForm(4),
    "Q4_1": ExactForm(4, "float16"),
    "Q4_K": ExactForm(4, "float32"),
    "Q6_K": ExactForm(8, block_size=16, in_tables=False, packed_bits=6),
}
# bytes of one block, and the inputs it covers
_BLOCK_BYTES = {
    "Q8_0": (34, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "Q5_K": (176, 256),
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q4_K": (144, 256),
    "Q6_K": (210, 256),
}


def block_inputs(kind: str) -> int:
    """The inputs one block of this type covers (a weight can be cut along K only at their multiples)."""
    return _BLOCK_BYTES[kind][1]


@dataclass(frozen=True)
class BlockQuantized:
    """One weight still in its GGUF blocks: `rows` is uint8 [out_features, in_features / block inputs x block
    bytes]."""

    kind: str
    rows: np.ndarray
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows.shape[0], self.in_features)

    def dequantize(self) -> torch.Tensor:
        import gguf

        weight = gguf.quants.dequantize(self.rows, gguf.GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32).reshape(self.shape))

    def to_matmul_nbits(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(packed uint8 [N, K / block, block * bits / 8], fp32 scales [N * K / block], minimums [N, K / block] or
        None), block 32 (Q6_K: 16)."""
        size, inputs = _BLOCK_BYTES[self.kind]
        blocks = self.rows.reshape(self.rows.shape[0], self.in_features // inputs, size)
        minimums = None
        if self.kind in ("Q4_K", "Q5_K"):
            values, scale, minimums = _k_quant_with_minimums(blocks, five_bits=self.kind == "Q5_K")
        elif self.kind == "Q6_K":
            values, scale = _q6_k(blocks)
        else:
            scale = _halves(blocks[..., 0:2]).astype(np.float32)
            if self.kind == "Q8_0":
                values = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            elif self.kind == "Q5_0":
                values = _five_bit_values(blocks[..., 2:6], blocks[..., 6:22]) + np.uint8(128 - 16)  # int8's zero point
            elif self.kind == "Q5_1":
                values, minimums = _five_bit_values(blocks[..., 4:8], blocks[..., 8:24]), _halves(blocks[..., 2:4])
            else:
                data = blocks[..., 2:] if self.kind == "Q4_0" else blocks[..., 4:]
                values = _low_then_high(data)
                if self.kind == "Q4_1":
                    minimums = _halves(blocks[..., 2:4])
        packed = pack_values(torch.from_numpy(np.ascontiguousarray(values)), EXACT_FORMS[self.kind].bits)
        minimums = None if minimums is None else torch.from_numpy(np.ascontiguousarray(minimums))
        return packed, torch.from_numpy(np.ascontiguousarray(scale).reshape(-1)), minimums


def _halves(pairs: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float16."""
    return pairs.copy().view(np.float16)[..., 0]


def _low_then_high(data: np.ndarray, axis: int = -1) -> np.ndarray:
    """Bytes -> their nibbles in ggml's order along `axis`: the low ones, then the high ones (a Q4_0 block's 16 bytes
    hold its 32 values so; a Q4_K pair of 32 bytes its two sub-blocks)."""
    return np.concatenate((data & 0x0F, data >> 4), axis=axis)


def _five_bit_values(high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 blocks' fifth bits [..., 4] and low nibbles [..., 16] -> their unsigned 5-bit values [..., 32]:
    bit j of the little-endian 32-bit word is value j's fifth bit."""
    word = high.copy().view("<u4")  # [..., 1]
    fifth = ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _low_then_high(low) | (fifth << 4)


def _k_quant_with_minimums(blocks: np.ndarray, five_bits: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [N, K / 256, 144] (Q5_K's [..., 176] where `five_bits`) -> the values [N, K / 32, 32],
    float32 scales d x sc [N, K / 32] and minimums -(dmin x m) [N, K / 32] of their 32-input sub-blocks."""
    out_features, supers, _ = blocks.shape
    d, dmin = _halves(blocks[..., 0:2]).astype(np.float32), _halves(blocks[..., 2:4]).astype(np.float32)
    packed = blocks[..., 4:16].astype(np.uint8)  # llama.cpp's get_scale_min_k4
    sc = np.concatenate((packed[..., 0:4] & 63, (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)), -1)
    m = np.concatenate((packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)), -1)
    low = blocks[..., 48:] if five_bits else blocks[..., 16:]
    values = _low_then_high(low.reshape(out_features, supers, 4, 1, 32), axis=-2).reshape(out_features, supers, 8, 32)
    if five_bits:  # byte i of the 32 after the scales: bit s the fifth bit of input i of sub-block s
        high = blocks[..., 16:48].reshape(out_features, supers, 1, 32)
        values = values | (((high >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1) << 4)
    scale = (d[..., None] * sc.astype(np.float32)).reshape(out_features, -1)
    minimum = -(dmin[..., None] * m.astype(np.float32)).reshape(out_features, -1)
    return values.reshape(out_features, supers * 8, 32), scale, minimum


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks [N, K / 256, 210] -> the values q - 32 stored with int8's zero point [N, K / 16, 16] and
    float32 scales d x sc [N, K / 16] of their 16-input sub-blocks. Per half of 128 inputs, 64 bytes of low nibbles
    l and 32 of high bit pairs h: input i < 32 has l[i]'s low nibble and h[i]'s bits 0-1, 32 + i l[32 + i]'s low
    and h[i]'s bits 2-3, 64 + i l[i]'s high and bits 4-5, 96 + i l[32 + i]'s high and bits 6-7 (dequantize_row_q6_K)."""
    out_features, supers, _ = blocks.shape
    low = blocks[..., :128].reshape(out_features, supers, 2, 2, 32)  # [.., half, l[0:32] / l[32:64], i]
    high = blocks[..., 128:192].reshape(out_features, supers, 2, 1, 1, 32)
    nibbles = np.stack((low & 0x0F, low >> 4), axis=-3)  # [.., half, low / high nibble, which l, i]
    pairs = (high >> (2 * np.arange(4, dtype=np.uint8)).reshape(2, 2, 1)) & 3  # bits 0-1, 2-3, 4-5, 6-7 alike
    values = nibbles | (pairs << 4)
    scale = _halves(blocks[..., 208:210]).astype(np.float32)[..., None] * blocks[..., 192:208].view(np.int8)
    return (values.reshape(out_features, -1, 16) + np.uint8(128 - 32)), scale.reshape(out_features, -1)
