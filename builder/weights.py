"""Fill the model's parameters from a checkpoint's lazy tensor stream, one tensor at a time.

Checkpoints name q/k/v and gate/up projections apart; the model runs each group as one fused matmul, so those
tensors are copied into row ranges of the fused weight as they stream by.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from builder.loaders.checkpoint import CheckpointError
from builder.model import LlamaForCausalLM
from engines.model_config import ModelConfig

# Checkpoint entries that carry no model weight (rotary tables some exporters save).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_FUSED_PATTERN = re.compile(r"(.*)\.(self_attn\.[qkv]_proj|mlp\.gate_proj|mlp\.up_proj)\.(weight|bias)")


def fused_rows(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Checkpoint projection -> (fused projection, first row, end row)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inner = config.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inner),
        "mlp.up_proj": ("mlp.gate_up_proj", inner, 2 * inner),
    }


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))


def load_model(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> LlamaForCausalLM:
    """Build the model on the meta device and give each parameter its checkpoint tensor as it streams by."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype)
    expected = dict(model.named_parameters())
    rows = fused_rows(config)
    filled: dict[str, int] = {}  # parameter -> rows (or whole tensors) loaded
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        target, start, stop = name, 0, None
        fused = _FUSED_PATTERN.fullmatch(name)
        if fused is not None:
            prefix, projection, kind = fused.groups()
            fused_name, start, stop = rows[projection]
            target = f"{prefix}.{fused_name}.{kind}"
        if target not in expected:
            raise CheckpointError(f"unexpected tensor {name!r} in checkpoint (not a Llama weight)")
        want = expected[target].shape
        want = want if stop is None else (stop - start, *want[1:])
        if tuple(tensor.shape) != tuple(want):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, config implies {tuple(want)}")
        if stop is None:
            _set_parameter(model, target, tensor.to(dtype))
            filled[target] = expected[target].shape[0] if expected[target].dim() else 1
            continue
        param = model.get_parameter(target)
        if param.is_meta:
            _set_parameter(model, target, torch.empty(expected[target].shape, dtype=dtype))
            param = model.get_parameter(target)
        param.data[start:stop] = tensor.to(dtype)
        filled[target] = filled.get(target, 0) + (stop - start)
    missing = sorted(n for n, p in expected.items() if filled.get(n, 0) != (p.shape[0] if p.dim() else 1))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"checkpoint is missing weights for {', '.join(missing[:3])}{more}")
    return model.eval()
