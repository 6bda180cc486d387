"""The collectives of a tensor-parallel step graph: AllReduce (the sum of every rank's partial result, after each
row-parallel linear) and AllGather (the vocabulary-parallel LM head's logits, concatenated in rank order).

In the graph they are our ops (plugins/collectives.c in the kernel library): between the rank processes of one
host through a shared-memory segment, which the runner creates (runner/core/shared_segment.py) and hands to the
library of each rank's process before its session runs. In torch they are custom ops whose eager form runs over
torch.distributed (for tests of a sharded model in torch), and which the exporter lowers to our nodes.
"""

from __future__ import annotations

import torch

from plugins.native_ops import DOMAIN
from plugins.onnx_schema import register_contrib_op


@torch.library.custom_op("plugins::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks of torch.distributed's default group."""
    total = x.clone()
    torch.distributed.all_reduce(total)
    return total


@all_reduce.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("plugins::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, offset: int, total: int) -> torch.Tensor:
    """Every rank's `x` [..., size_r] placed at its `offset` of a last axis of `total`: [..., total]."""
    gathered = x.new_zeros(*x.shape[:-1], total)
    gathered[..., offset : offset + x.shape[-1]] = x
    torch.distributed.all_reduce(gathered)  # each position is one rank's value plus zeros: exact
    return gathered


@all_gather.register_fake
def _(x, offset, total):
    return x.new_empty(*x.shape[:-1], total)


def onnx_translations() -> dict:
    """custom_translation_table entries for torch.onnx.export."""
    import onnxscript

    register_contrib_op("AllReduce", ["X:T"], ["Y:T"], {"T": ["tensor(float)"]}, {}, domain=DOMAIN)
    register_contrib_op(
        "AllGather", ["X:T"], ["Y:T"], {"T": ["tensor(float)"]}, {"offset": int, "total": int}, domain=DOMAIN
    )
    ours = onnxscript.values.Opset(DOMAIN, 1)

    def all_reduce_to_onnx(x):
        return ours.AllReduce(x)

    def all_gather_to_onnx(x, offset: int, total: int):
        return ours.AllGather(x, offset=offset, total=total)

    return {
        torch.ops.plugins.all_reduce.default: all_reduce_to_onnx,
        torch.ops.plugins.all_gather.default: all_gather_to_onnx,
    }
