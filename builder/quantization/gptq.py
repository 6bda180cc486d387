"""GPTQ (Frantar et al., 2022): int4 weights chosen column by column so that each rounding error is compensated
by the columns not yet quantized, weighted by the layer's input statistics H = 2 X^T X on calibration text.

Layer by layer, as in the paper: the calibration tokens' hidden states enter decoder layer i; its four linears
(qkv, o, gate_up, down) collect H from their float inputs; each is quantized; the layer then runs again with the
quantized weights to give layer i + 1 its inputs, so later layers see (and correct for) earlier layers' errors.

The result is the same symmetric MatMulNBits layout as round-to-nearest (plugins/quant_linear.py). Groups are
static: each group's scale is RTN's, from the float weight, so act-order's column permutation still leaves the
contiguous groups MatMulNBits needs (AutoGPTQ's `static_groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from builder.model import LlamaForCausalLM
from plugins.quant_linear import QuantizedLinear, QuantSpec, blocks, pack_values, quantize_blockwise

# builder/quantization/calibration/README.md says what these are and their licences: general prose the default model
# wrote and technical prose. Calibrating on the docstrings alone overfitted to them (docs/measurements.md).
_CALIBRATION_DIR = Path(__file__).parent / "calibration"
DEFAULT_CALIBRATION = (_CALIBRATION_DIR / "smollm2_answers.txt", _CALIBRATION_DIR / "python_stdlib_docstrings.txt")
_LAZY_BATCH = 128  # columns whose updates are applied to the rest of the matrix at once
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class GPTQOptions:
    # added to H's diagonal, as a fraction of its mean: 0.1 rather than the paper's 0.01, chosen when 0.01 fitted
    # the calibration tokens too closely; with the Q4_0-rule scales both give the same perplexity (12.57 / 12.60)
    damping: float = 0.1
    act_order: bool = True  # quantize the columns with the largest H diagonal (most used inputs) first
    samples: int = 48  # calibration sequences
    sample_len: int = 256  # tokens per sequence
    calibration: tuple[Path, ...] = DEFAULT_CALIBRATION  # texts, concatenated
    batch: int = 8  # sequences per forward pass (bounds the attention scores' memory)

    def __post_init__(self) -> None:
        if not 0 < self.damping < 1:
            raise ValueError("GPTQ damping must be in (0, 1)")
        if self.samples < 1 or self.sample_len < 2:
            raise ValueError("GPTQ needs at least one calibration sequence of 2 or more tokens")


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    block_size: int,
    damping: float,
    act_order: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ of `weight` [N, K] given H [K, K] -> (packed uint8, fp32 scales), the layout of quantize_blockwise."""
    out_features, in_features = weight.shape
    # float64 only where it matters (H's factorisations); the weight-sized arrays stay fp32 / int8, as a
    # 49152 x 576 LM head would otherwise take ~1 GB here
    w = weight.detach().to(torch.float32).clone()
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diag(h) == 0  # inputs that were always zero: any value is exact, keep the row's RTN
    h[dead, dead] = 1.0
    _, scales = quantize_blockwise(weight.float(), bits, block_size)
    column_scale = scales.view(out_features, -1).repeat_interleave(block_size, dim=1)[:, :in_features]
    order = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(in_features)
    w, h, column_scale = w[:, order], h[order][:, order], column_scale[:, order]
    h += damping * torch.mean(torch.diag(h)) * torch.eye(in_features, dtype=torch.float64)
    # the upper Cholesky factor of H^-1: row i holds how column i's error spreads over the columns after it
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(torch.float32)
    zero, qmax = 1 << (bits - 1), (1 << (bits - 1)) - 1
    codes = torch.zeros(out_features, in_features, dtype=torch.int8)
    for start in range(0, in_features, _LAZY_BATCH):
        end = min(start + _LAZY_BATCH, in_features)
        block, errors = w[:, start:end].clone(), torch.zeros(out_features, end - start)
        for i in range(end - start):
            column, scale = block[:, i], column_scale[:, start + i]
            q = torch.clamp(torch.round(column / scale), -zero, qmax)
            codes[:, start + i] = q.to(torch.int8)
            errors[:, i] = (column - q * scale) / h_inv[start + i, start + i]
            block[:, i:] -= errors[:, i : i + 1] * h_inv[start + i, start + i : end].unsqueeze(0)
        w[:, end:] -= errors @ h_inv[start:end, end:]
    codes = codes[:, torch.argsort(order)]
    values = torch.full((out_features, blocks(in_features, block_size) * block_size), zero, dtype=torch.uint8)
    values[:, :in_features] = (codes.to(torch.int16) + zero).to(torch.uint8)
    values = values.view(out_features, -1, block_size)
    return pack_values(values, bits), scales


class _HessianCollector:
    """H = 2/n sum x^T x over every input row a linear sees, accumulated as a running mean."""

    def __init__(self, in_features: int) -> None:
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.rows = 0

    def __call__(self, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        x = inputs[0].reshape(-1, inputs[0].shape[-1]).to(torch.float64)
        total = self.rows + x.shape[0]
        self.hessian *= self.rows / total
        x = x * (2.0 / total) ** 0.5
        self.hessian += x.t() @ x
        self.rows = total


class _StopForward(Exception):
    pass


def calibration_tokens(
    encode: Callable[[str], list[int]], texts: Iterable[Path], samples: int, sample_len: int
) -> torch.Tensor:
    """[samples, sample_len] token ids: consecutive windows spread evenly over the calibration texts."""
    ids = encode("\n\n".join(Path(path).read_text(encoding="utf-8") for path in texts))
    if len(ids) < sample_len:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than a sample's {sample_len}")
    windows = len(ids) - sample_len + 1
    count = min(samples, windows)
    starts = torch.linspace(0, windows - 1, count).round().long().tolist()
    return torch.tensor([ids[s : s + sample_len] for s in starts])


def _quantized_copy(linear: nn.Module, spec: QuantSpec, hessian: torch.Tensor, options: GPTQOptions) -> QuantizedLinear:
    weight, bias = linear.weight, getattr(linear, "bias", None)  # an embedding table (tied LM head) has no bias
    quantized = QuantizedLinear(weight.shape[1], weight.shape[0], bias is not None, weight.dtype, spec)
    qweight, scales = gptq_quantize(weight, hessian, spec.bits, spec.block_size, options.damping, options.act_order)
    quantized.load_quantized_rows(0, qweight, scales)
    if bias is not None:
        quantized.bias.data.copy_(bias)
    return quantized


@torch.no_grad()
def gptq_model(
    model: LlamaForCausalLM,
    tokens: torch.Tensor,
    spec: QuantSpec,
    quantize_lm_head: bool,
    options: GPTQOptions,
    log: Callable[[str], None] = lambda _: None,
) -> LlamaForCausalLM:
    """Replace every linear of the float `model` (and its LM head if asked) by its GPTQ QuantizedLinear, in place."""
    config = model.config
    steps = tokens.shape[1]
    layers = model.model.layers
    # per chunk: a layer's input and running residual (see DecoderLayer.forward), then its other arguments
    inputs: list[tuple[tuple[torch.Tensor, torch.Tensor | None], tuple, dict]] = []

    def capture(module, args, kwargs):
        inputs.append((args[:2], args[2:], kwargs))
        raise _StopForward

    handle = layers[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        for chunk in tokens.split(options.batch):
            batch = chunk.shape[0]
            cache = torch.zeros(batch, config.num_kv_heads, steps, config.head_dim, dtype=model.dtype)
            try:
                model(
                    chunk,
                    torch.arange(steps).expand(batch, steps),
                    torch.zeros(batch, dtype=torch.long),
                    torch.full((batch,), steps),
                    torch.zeros(batch, 1, steps, steps),
                    torch.zeros(batch, 1, dtype=torch.long),
                    [cache] * config.num_layers,
                    [cache] * config.num_layers,
                )
            except _StopForward:
                pass
    finally:
        handle.remove()

    for index, layer in enumerate(layers):
        collectors = {name: _HessianCollector(layer.get_submodule(name).weight.shape[1]) for name in _LINEARS}
        handles = [layer.get_submodule(name).register_forward_pre_hook(c) for name, c in collectors.items()]
        for x, args, kwargs in inputs:
            layer(*x, *args, **kwargs)
        for h in handles:
            h.remove()
        for name, collector in collectors.items():
            layer.set_submodule(name, _quantized_copy(layer.get_submodule(name), spec, collector.hessian, options))
        inputs = [(layer(*x, *args, **kwargs)[:2], args, kwargs) for x, args, kwargs in inputs]
        log(f"      GPTQ layer {index + 1}/{len(layers)}")
    if quantize_lm_head:
        collector = _HessianCollector(config.hidden_size)
        for x, _, _ in inputs:
            collector(None, (model.model.norm(*x)[0],))
        head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
        model.lm_head = _quantized_copy(head, spec, collector.hessian, options)
        log("      GPTQ LM head")
    return model
