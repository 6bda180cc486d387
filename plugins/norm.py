"""RMSNorm, and the residual add + RMSNorm pair that every decoder layer runs twice, as one fused op.

- `rms_norm`: plain torch, written as x / sqrt(mean(x^2) + eps) because onnxruntime fuses that pattern into one
  SimplifiedLayerNormalization kernel (the first layer's input norm);
- `torch.ops.plugins.add_rms_norm`: (x + residual, rms_norm(x + residual)) with its reference and fake kernel,
  lowered to com.microsoft::SkipSimplifiedLayerNormalization. onnxruntime's own fusion of Add + norm does not fire
  on our graph (the running sum feeds the next add too), and an unfused Add per norm is ~60 more nodes per step.
- `use_in_graph`: those nodes as our SkipRmsNorm kernel (norm.c) wherever the engine ships our kernel library
  anyway: onnxruntime's hands a call's rows to another thread from two rows up, which costs a verify step or a
  decode batch more than the rows' work.
"""

from __future__ import annotations

from pathlib import Path

import torch

from plugins.native_ops import DOMAIN, float_tensors, rewrite_nodes
from plugins.onnx_schema import register_contrib_op


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 whatever the weight dtype, as the reference implementation does.
    x32 = x.float()
    x32 = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_then_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(x + residual), x + residual) in plain torch ops: the op's reference, and what the torch
    backends trace (a compiled package must not call back into ops defined in Python)."""
    total = x + residual
    return rms_norm(total, weight, eps), total


@torch.library.custom_op("plugins::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(x + residual), x + residual). Reference for eager runs and tests."""
    return add_then_rms_norm(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


def _register_schema() -> None:
    register_contrib_op(
        "SkipSimplifiedLayerNormalization",
        inputs=["input:T", "skip:T", "gamma:T", "bias?:T"],
        outputs=["output:T", "mean?:U", "inv_std_var?:U", "input_skip_bias_sum?:T"],
        types={"T": ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "U": ["tensor(float)"]},
        attributes={"epsilon": float},
    )


def onnx_translations() -> dict:
    """custom_translation_table entries for torch.onnx.export."""
    import onnxscript

    _register_schema()
    microsoft = onnxscript.values.Opset("com.microsoft", 1)

    def add_rms_norm_to_onnx(x, residual, weight, eps: float):
        normed, _, _, total = microsoft.SkipSimplifiedLayerNormalization(x, residual, weight, epsilon=eps)
        return normed, total

    return {torch.ops.plugins.add_rms_norm.default: add_rms_norm_to_onnx}


def use_in_graph(graph_file: Path) -> int:
    """Replace each SkipSimplifiedLayerNormalization of `graph_file` that our kernel computes (float input, skip and
    gamma of one width, no bias, neither its mean nor its inverse deviation used) by our SkipRmsNorm; returns how
    many."""
    import onnx
    from onnx import helper

    floats = float_tensors(onnx.load(str(graph_file), load_external_data=False).graph)

    def replace(node):
        if node.op_type != "SkipSimplifiedLayerNormalization" or node.domain != "com.microsoft":
            return None
        if len(node.input) != 3 or not all(name in floats for name in node.input):
            return None
        outputs = [*node.output, "", "", ""][:4]
        if outputs[1] or outputs[2]:
            return None
        epsilon = [helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon"]
        if not epsilon:  # onnxruntime's default, which the export never leaves to it
            return None
        total = outputs[3] or f"{outputs[0]}.unused_sum"
        return helper.make_node(
            "SkipRmsNorm", list(node.input), [outputs[0], total], name=node.name, domain=DOMAIN, epsilon=epsilon[0]
        )

    return rewrite_nodes(graph_file, replace)
