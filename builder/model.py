"""The Llama-family transformer as one readable module, written for export with a static, runner-owned KV cache.

One forward serves every phase (prefill chunk, decode, verify): B rows of T new tokens each, every row with its
own positions and its own number of cached positions. The cache is an *input* (the runner owns it) and only the
K/V of the T new tokens come out; the runner writes them into its buffer in place, so no step copies the cache.

Cache layout per layer (chosen so that a bucket-sized buffer feeds attention with no transpose or copy):
    past_keys[i]:   [B, kv_heads, head_dim, L]   (K already transposed for q @ K^T)
    past_values[i]: [B, kv_heads, L, head_dim]
The new tokens' K/V come out as new_keys / new_values [layers, B, T, kv_heads, head_dim] (the projection's layout).
Positions >= past_lens[b] of row b are padding and masked out. Among the T new tokens, `tree_mask[b, t, s]` says
whether new token t attends to new token s: lower-triangular for a prefill chunk or a linear draft, a tree for
tree verification, the identity for padding rows (so no row is ever fully masked).

Weight names follow Hugging Face (`model.layers.0.self_attn.q_proj.weight`, ...), so checkpoints load by name.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engines.model_config import ModelConfig
from plugins.linear import make_linear
from plugins.quant_linear import QuantSpec


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with llama3-style scaling when the config asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = config.rope_scaling
    if scaling is not None:
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelen > low_wavelen, inv_freq / scaling.factor, torch.where(wavelen < high_wavelen, inv_freq, smoothed)
        )
    return inv_freq.float()


def rotate_half_matrix(head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """R with x @ R == cat(-x[half:], x[:half]): one exact MatMul in the graph instead of split/neg/concat."""
    half = head_dim // 2
    rotation = torch.zeros(head_dim, head_dim, dtype=dtype, device="cpu")  # cpu even when built on meta
    index = torch.arange(half, device="cpu")
    rotation[index + half, index] = -1.0
    rotation[index, index + half] = 1.0
    return rotation


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the weight dtype, as the reference implementation does. Written as
        # x / sqrt(...) because onnxruntime fuses that pattern into one SimplifiedLayerNormalization kernel.
        x32 = x.float()
        x32 = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, quant: QuantSpec | None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        # q, k and v in one matmul (the checkpoint's q_proj/k_proj/v_proj are stacked by row at load time)
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = make_linear(hidden, qkv_rows, bias, dtype, quant)
        self.o_proj = make_linear(config.num_heads * config.head_dim, hidden, bias, dtype, quant)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, T, 1, head_dim]
        sin: torch.Tensor,
        rotation: torch.Tensor,  # [head_dim, head_dim], see rotate_half_matrix
        mask_bias: torch.Tensor,  # [B, 1, group * T, L + T] float32: 0 = attend, float32 min = masked
        past_key: torch.Tensor,  # [B, kv_heads, head_dim, L]
        past_value: torch.Tensor,  # [B, kv_heads, L, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, steps, _ = x.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        group = heads // kv_heads
        past_len = past_key.shape[-1]

        qkv = self.qkv_proj(x).view(batch, steps, heads + 2 * kv_heads, head_dim)
        qk, v = qkv.split([heads + kv_heads, kv_heads], dim=2)
        qk = qk * cos + (qk @ rotation) * sin  # rotary embedding of q and k at once
        q, k = qk.split([heads, kv_heads], dim=2)

        # Query heads sharing a KV head are stacked along the row axis, so GQA needs no repeat of K/V.
        q = q.reshape(batch, steps, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(batch, kv_heads, group * steps, head_dim) * (1.0 / math.sqrt(head_dim))

        # Scores against the cache and against the new tokens are computed apart: concatenating K/V would copy
        # the whole cache on every step.
        scores = torch.cat((q @ past_key, q @ k.permute(0, 2, 3, 1)), dim=-1)
        scores = scores.float() + mask_bias
        probs = torch.softmax(scores, dim=-1).to(x.dtype)
        out = probs[..., :past_len] @ past_value + probs[..., past_len:] @ v.transpose(1, 2)
        out = out.view(batch, kv_heads, group, steps, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(batch, steps, heads * head_dim)
        # new K/V leave in the projection's own layout [B, T, kv_heads, head_dim]; the runner places them
        return self.o_proj(out), k, v


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, quant: QuantSpec | None) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.inner = inner
        # gate and up in one matmul (gate_proj/up_proj stacked by row at load time)
        self.gate_up_proj = make_linear(hidden, 2 * inner, bias, dtype, quant)
        self.down_proj = make_linear(inner, hidden, bias, dtype, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inner, self.inner], dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, quant: QuantSpec | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype, quant)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, quant)

    def forward(self, x, cos, sin, rotation, mask_bias, past_key, past_value):
        attn_out, new_key, new_value = self.self_attn(
            self.input_layernorm(x), cos, sin, rotation, mask_bias, past_key, past_value
        )
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_key, new_value


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, quant: QuantSpec | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, quant) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Inputs and outputs are those of the engine's step graph (see the module docstring)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, quant: QuantSpec | None = None,
        quantize_lm_head: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = Backbone(config, dtype, quant)
        # A quantized LM head is its own (quantized) copy even when tied: the embedding stays float for lookups.
        head_quant = quant if quantize_lm_head else None
        untied = not config.tie_word_embeddings or head_quant is not None
        self.lm_head = make_linear(config.hidden_size, config.vocab_size, False, dtype, head_quant) if untied else None
        self.register_buffer("rope_inv_freq", rope_inv_freq(config), persistent=False)
        self.register_buffer("rope_rotation", rotate_half_matrix(config.head_dim, dtype), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64
        past_lens: torch.Tensor,  # [B] int64: valid cached positions per row
        tree_mask: torch.Tensor,  # [B, T, T] bool
        logits_index: torch.Tensor,  # [B, N] int64: which of the T new tokens get logits
        past_keys: list[torch.Tensor],
        past_values: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, steps = input_ids.shape
        past_len = past_keys[0].shape[-1]
        group = self.config.num_heads // self.config.num_kv_heads

        freqs = positions.unsqueeze(-1).float() * self.rope_inv_freq
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [B, T, 1, head_dim]: shared by all heads
        cos, sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)

        # One mask for all layers, rows ordered (query head in group, new token) like the attention scores.
        cached = torch.arange(past_len, device=input_ids.device).unsqueeze(0) < past_lens.unsqueeze(1)  # [B, L]
        mask = torch.cat((cached.unsqueeze(1).expand(batch, steps, past_len), tree_mask), dim=-1)
        mask = mask.unsqueeze(1).expand(batch, group, steps, past_len + steps).reshape(batch, 1, group * steps, past_len + steps)
        # additive, built once: an Add per layer is much cheaper than a broadcasting Where over the scores
        mask_bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, torch.finfo(torch.float32).min)

        x = self.model.embed_tokens(input_ids)
        new_keys, new_values = [], []
        for layer, past_key, past_value in zip(self.model.layers, past_keys, past_values):
            x, new_key, new_value = layer(x, cos, sin, self.rope_rotation, mask_bias, past_key, past_value)
            new_keys.append(new_key)
            new_values.append(new_value)

        index = logits_index.unsqueeze(-1).expand(batch, logits_index.shape[1], x.shape[-1])
        hidden = self.model.norm(torch.gather(x, 1, index))
        if self.lm_head is None:
            logits = hidden @ self.model.embed_tokens.weight.t()
        else:
            logits = self.lm_head(hidden)
        return logits.float(), torch.stack(new_keys), torch.stack(new_values), hidden
