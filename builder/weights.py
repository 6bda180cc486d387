"""Fill the model's parameters from a checkpoint's lazy tensor stream, one tensor at a time."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from builder.loaders.checkpoint import CheckpointError
from builder.model import LlamaForCausalLM
from engines.model_config import ModelConfig

# Checkpoint entries that carry no model weight (rotary tables some exporters save).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> LlamaForCausalLM:
    """Build the model on the meta device and give each parameter its checkpoint tensor as it streams by."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype)
    expected = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {name!r} in checkpoint (not a Llama weight)")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, config implies {tuple(expected[name].shape)}"
            )
        owner_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner_name), leaf, nn.Parameter(tensor.to(dtype), requires_grad=False))
        loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"checkpoint is missing {', '.join(missing[:3])}{more}")
    return model.eval()
