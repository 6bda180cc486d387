"""The Llama-family transformer as one readable module, written for export with a static, runner-owned KV cache.

One forward serves every phase (prefill chunk, decode, verify): B rows of T new tokens each, every row with its
own positions and its own number of cached positions. The cache is an *input* (the runner owns it) and only the
K/V of the T new tokens come out; the runner writes them into its buffer in place, so no step copies the cache.

Cache layout per layer (chosen so that a bucket-sized buffer feeds attention with no transpose or copy):
    past_keys[i]:   [B, kv_heads, head_dim, L]   (K already transposed for q @ K^T)
    past_values[i]: [B, kv_heads, L, head_dim]
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the weight dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = make_linear(hidden, config.num_heads * config.head_dim, bias, dtype)
        self.k_proj = make_linear(hidden, config.num_kv_heads * config.head_dim, bias, dtype)
        self.v_proj = make_linear(hidden, config.num_kv_heads * config.head_dim, bias, dtype)
        self.o_proj = make_linear(config.num_heads * config.head_dim, hidden, bias, dtype)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, T, head_dim]
        sin: torch.Tensor,
        mask: torch.Tensor,  # [B, 1, 1, T, L + T] bool, True = attend
        past_key: torch.Tensor,  # [B, kv_heads, head_dim, L]
        past_value: torch.Tensor,  # [B, kv_heads, L, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, steps, _ = x.shape
        kv_heads, head_dim = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        past_len = past_key.shape[-1]

        q = self.q_proj(x).view(batch, steps, self.num_heads, head_dim)
        k = self.k_proj(x).view(batch, steps, kv_heads, head_dim)
        v = self.v_proj(x).view(batch, steps, kv_heads, head_dim)
        q = q * cos[:, :, None, :] + rotate_half(q) * sin[:, :, None, :]
        k = k * cos[:, :, None, :] + rotate_half(k) * sin[:, :, None, :]

        # Query heads sharing a KV head are stacked along the row axis, so GQA needs no repeat of K/V.
        q = q.view(batch, steps, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(batch, kv_heads, group * steps, head_dim) * (1.0 / math.sqrt(head_dim))
        new_key = k.transpose(1, 2)  # [B, kv_heads, T, head_dim]
        new_value = v.transpose(1, 2)

        # Scores against the cache and against the new tokens are computed apart: concatenating K/V would copy
        # the whole cache on every step.
        scores = torch.cat((q @ past_key, q @ new_key.transpose(2, 3)), dim=-1)
        scores = scores.view(batch, kv_heads, group, steps, past_len + steps).float()
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(x.dtype).view(batch, kv_heads, group * steps, past_len + steps)
        out = probs[..., :past_len] @ past_value + probs[..., past_len:] @ new_value
        out = out.view(batch, kv_heads, group, steps, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(batch, steps, self.num_heads * head_dim)
        return self.o_proj(out), new_key, new_value


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = make_linear(hidden, inner, bias, dtype)
        self.up_proj = make_linear(hidden, inner, bias, dtype)
        self.down_proj = make_linear(inner, hidden, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, x, cos, sin, mask, past_key, past_value):
        attn_out, new_key, new_value = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_key, past_value)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_key, new_value


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Inputs and outputs are those of the engine's step graph (see the module docstring)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = Backbone(config, dtype)
        self.lm_head = None if config.tie_word_embeddings else make_linear(
            config.hidden_size, config.vocab_size, False, dtype
        )
        self.register_buffer("rope_inv_freq", rope_inv_freq(config), persistent=False)

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

        freqs = positions.unsqueeze(-1).float() * self.rope_inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)

        cached = torch.arange(past_len, device=input_ids.device).unsqueeze(0) < past_lens.unsqueeze(1)  # [B, L]
        mask = torch.cat((cached.unsqueeze(1).expand(batch, steps, past_len), tree_mask), dim=-1)
        mask = mask.view(batch, 1, 1, steps, past_len + steps)

        x = self.model.embed_tokens(input_ids)
        new_keys, new_values = [], []
        for layer, past_key, past_value in zip(self.model.layers, past_keys, past_values):
            x, new_key, new_value = layer(x, cos, sin, mask, past_key, past_value)
            new_keys.append(new_key)
            new_values.append(new_value)

        index = logits_index.unsqueeze(-1).expand(batch, logits_index.shape[1], x.shape[-1])
        hidden = self.model.norm(torch.gather(x, 1, index))
        if self.lm_head is None:
            logits = hidden @ self.model.embed_tokens.weight.t()
        else:
            logits = self.lm_head(hidden)
        return logits.float(), torch.stack(new_keys), torch.stack(new_values), hidden
