"""The linear layer every projection of the model goes through.

The model never calls `nn.Linear` itself: it asks `make_linear` for its projections, so the quantized variant
(plugins/quant_linear.py: int8/int4 weights lowered to a fused quantized matmul) replaces the float one without
touching the model code. `FloatLinear` is plain `x @ W^T (+ b)`, which the ONNX exporter lowers to a MatMul on the
weight initializer. `StackedLinear` runs one projection as parts stored in different forms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plugins.quant_linear import QuantizedLinear, QuantSpec


class FloatLinear(nn.Module):
    """`y = x @ weight.T + bias` with the weight in the Hugging Face layout `[out_features, in_features]`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class StackedLinear(nn.Module):
    """One projection as several linears over consecutive row ranges of its weight, outputs concatenated: a fused
    projection whose parts are stored in different forms (a GGUF file's Q4_K queries and keys beside its Q6_K
    values), each part one matmul in its own form."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def make_linear(
    in_features: int, out_features: int, bias: bool, dtype: torch.dtype, quant: QuantSpec | None = None
) -> nn.Module:
    if quant is None:
        return FloatLinear(in_features, out_features, bias, dtype)
    return QuantizedLinear(in_features, out_features, bias, dtype, quant)
