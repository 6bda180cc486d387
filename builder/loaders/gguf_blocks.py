"""GGUF block-quantized weights, taken as they are into the engine's quantized linears where the formats agree.

llama.cpp's blocks hold 32 consecutive inputs of one output row, fp16 scale first:
- Q8_0: d, 32 x int8 q                                       w = d * q
- Q4_0: d, 16 bytes (q[j] low nibble, q[j + 16] high nibble)  w = d * (q - 8)
- Q4_1: d, m, 16 bytes in the same nibble order               w = d * q + m
Our quantized linear (plugins/quant_linear.py) holds scale * (q - 2^(bits-1)), or scale * q + minimum with a float16
minimum per block, with 32-input blocks, so all three map without loss: the integers are repacked, the fp16 scales
widened (exactly) and Q4_1's fp16 minimum kept as it is. Any other GGUF type is dequantized and requantized by the
build.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from plugins.quant_linear import pack_values

BLOCK = 32
# GGUF type -> (bits, has minimums) of the MatMulNBits form that holds it exactly
EXACT_FORMS = {"Q8_0": (8, False), "Q4_0": (4, False), "Q4_1": (4, True)}
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


@dataclass(frozen=True)
class BlockQuantized:
    """One weight still in its GGUF blocks: `rows` is uint8 [out_features, in_features / 32 * block bytes]."""

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
        """(packed uint8 [N, blocks, 32 * bits / 8], fp32 scales [N * blocks], fp16 minimums [N, blocks] or None)."""
        out_features = self.rows.shape[0]
        blocks = self.rows.reshape(out_features, self.in_features // BLOCK, _BLOCK_BYTES[self.kind])
        scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if self.kind == "Q8_0":
            values = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            minimums = None
        else:
            data = blocks[..., 2:] if self.kind == "Q4_0" else blocks[..., 4:]
            values = np.concatenate((data & 0x0F, data >> 4), axis=-1)  # ggml order: first 16 low, last 16 high
            minimums = None
            if self.kind == "Q4_1":
                minimums = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
        bits = EXACT_FORMS[self.kind][0]
        return pack_values(torch.from_numpy(values), bits), torch.from_numpy(scale.reshape(-1)), minimums
