"""int8 KV cache: static per-channel scales, calibrated at build time on text.

onnxruntime's GroupQueryAttention keeps an int8 cache itself (plugins/attention.py): it stores each new token's K/V
as round(x / scale) and reads positions back as int8 * scale, with one scale per (kv head, channel) per layer. A
cached position then costs a quarter of its float32 bytes, and attention over a long cache reads a quarter as much.

Scales come from running the model (the engine's own weights, quantized or not) over calibration windows with a
float cache and taking, per channel, the largest magnitude seen, mapped to 127:
- V: max |v| per channel.
- K is stored after the rotary embedding, which turns channel i and channel i + head_dim/2 together by a
  position-dependent angle. Any angle keeps each value within the pair's norm sqrt(k_i^2 + k_{i+d/2}^2), and the
  rotation keeps the norm, so the largest pair norm bounds both channels at every position, including positions
  the calibration never reached.
A value beyond what calibration saw saturates at the int8 range (the kernel's rule).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from builder.model import LlamaForCausalLM
from builder.quantization.gptq import DEFAULT_CALIBRATION, calibration_tokens
from plugins.attention import INT8_CACHE_MAX

SMALLEST_SCALE = 1e-8  # a channel that is always 0 still gets a finite scale


@dataclass(frozen=True)
class KVCalibration:
    samples: int = 16  # windows of the calibration text, each run from position 0
    sample_len: int = 256
    texts: tuple[Path, ...] = DEFAULT_CALIBRATION  # GPTQ's: builder/quantization/calibration/README.md

    def describe(self) -> str:
        return f"{' + '.join(p.name for p in self.texts)}: {self.samples} x {self.sample_len} tokens"


def calibration_windows(
    encode: Callable[[str], list[int]], calibration: KVCalibration, max_seq_len: int
) -> torch.Tensor:
    return calibration_tokens(encode, calibration.texts, calibration.samples, min(calibration.sample_len, max_seq_len))


@torch.no_grad()
def calibrate_kv_scales(model: LlamaForCausalLM, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(k_scale, v_scale) per layer, each [1, kv_heads, 1, head_dim], from float-cache runs over `tokens`
    [samples, sample_len], one window per call."""
    config = model.config
    half = config.head_dim // 2
    layers = config.num_layers
    key_pair_norm = torch.zeros(layers, config.num_kv_heads, half)
    value_max = torch.zeros(layers, config.num_kv_heads, config.head_dim)
    for window in tokens:
        keys, values = _float_cache_of(model, window)
        for layer in range(layers):
            k = keys[layer][0].float()  # [kv_heads, positions, head_dim]
            norm = torch.sqrt(k[..., :half] ** 2 + k[..., half:] ** 2).amax(dim=1)
            key_pair_norm[layer] = torch.maximum(key_pair_norm[layer], norm)
            value_max[layer] = torch.maximum(value_max[layer], values[layer][0].float().abs().amax(dim=1))
    key_max = torch.cat([key_pair_norm, key_pair_norm], dim=-1)
    return [(_scale(key_max[layer]), _scale(value_max[layer])) for layer in range(layers)]


def _scale(channel_max: torch.Tensor) -> torch.Tensor:
    """[kv_heads, head_dim] largest magnitudes -> the kernel's [1, kv_heads, 1, head_dim] scales."""
    scale = channel_max.clamp(min=SMALLEST_SCALE * INT8_CACHE_MAX) / INT8_CACHE_MAX
    return scale.view(1, scale.shape[0], 1, scale.shape[1])


def _float_cache_of(model: LlamaForCausalLM, window: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The float K/V cache after one prefill of `window` from position 0."""
    config = model.config
    steps = window.numel()
    cache = [
        torch.zeros(1, config.num_kv_heads, steps, config.head_dim, dtype=model.dtype) for _ in range(config.num_layers)
    ]
    outputs = model(
        window.view(1, steps),
        torch.arange(steps).view(1, steps),
        torch.zeros(1, dtype=torch.long),
        torch.full((1,), steps, dtype=torch.long),
        torch.zeros(1, 1, steps, steps),
        torch.zeros(1, 1, dtype=torch.long),
        cache,
        [c.clone() for c in cache],
    )
    presents = outputs[3:]
    return list(presents[: config.num_layers]), list(presents[config.num_layers :])
