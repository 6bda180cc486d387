"""The Llama-family transformer as one readable module, written for export with a static, runner-owned KV cache.

One forward serves every phase (prefill chunk, decode, verify): B rows of T new tokens each, every row with its
own positions and its own number of cached positions. The cache is an input the runner owns, one buffer per layer
for K and one for V, [B, kv_heads, L, head_dim]; attention (plugins/attention.py, onnxruntime's fused
GroupQueryAttention in the engine) writes the new tokens' K/V into it at each row's `past_lens[b] + t` and returns
it as `present_key.i` / `present_value.i`, which the runner binds to the very buffer it fed, so no step copies the
cache. New token t of row b attends to the row's cached positions and to new tokens 0..t, minus what
`attention_bias` [B, 1, T, max(past_lens) + T] masks (tree verification: a node sees only its ancestors). Only
the first `query_lens[b]` new tokens of row b are real: padding tokens never enter the cache, and a row with none
(a row a batched call passes over) is left as it is.

Weight names follow Hugging Face (`model.layers.0.self_attn.q_proj.weight`, ...), so checkpoints load by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engines.model_config import ModelConfig
from plugins.attention import attend_in_place, group_query_attention
from plugins.linear import make_linear
from plugins.norm import add_rms_norm, add_then_rms_norm, rms_norm
from plugins.quant_linear import QuantizedEmbedding, QuantizedLinear, QuantSpec


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


def rotary_tables(config: ModelConfig, positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x inverse frequency, [positions, head_dim / 2], computed in fp32 as Hugging Face does."""
    angles = torch.arange(positions, dtype=torch.float32, device="cpu").unsqueeze(1) * rope_inv_freq(config).unsqueeze(
        0
    )
    return angles.cos().to(dtype), angles.sin().to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.add_and_norm = add_rms_norm  # the op the ONNX engines lower; see LlamaForCausalLM.use_torch_ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(x + residual), x + residual): the residual add fused with the norm that follows it (one kernel
        in the engine); without a residual, (norm(x), x)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps), x
        return self.add_and_norm(x, residual, self.weight, self.eps)


@dataclass(frozen=True)
class StepAttention:
    """What every layer's attention needs about the step, computed once per step."""

    seqlens_k: torch.Tensor  # [B] int32: past_lens + query_lens - 1
    total_len: torch.Tensor  # [] int32: max(past_lens) + T
    positions: torch.Tensor  # [B, T] int64: rotary positions
    bias: torch.Tensor  # [B, 1, T, total_len]
    query_lens: torch.Tensor  # [B] int32
    cos: torch.Tensor  # [max positions, head_dim / 2]
    sin: torch.Tensor


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, quant: QuantSpec | None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim)
        hidden, bias = config.hidden_size, config.attention_bias
        # q, k and v in one matmul (the checkpoint's q_proj/k_proj/v_proj are stacked by row at load time); its
        # output is the packed qkv the fused attention kernel takes as it is
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = make_linear(hidden, qkv_rows, bias, dtype, quant)
        self.o_proj = make_linear(config.num_heads * config.head_dim, hidden, config.o_proj_bias, dtype, quant)
        # Qwen3 normalises each head's q and k; the fused kernel applies the rotary embedding after them
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        # an int8 cache's static per-channel scales [1, kv_heads, 1, head_dim] (builder/quantization/kv_quant.py); None:
        # the
        # cache holds the model's dtype
        self.register_buffer("k_scale", None)
        self.register_buffer("v_scale", None)
        self.attend = group_query_attention  # the op the ONNX engines lower; see LlamaForCausalLM.use_torch_ops

    def forward(
        self, x: torch.Tensor, step: StepAttention, past_key: torch.Tensor, past_value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            qkv = self._normalise_heads(qkv)
        out, present_key, present_value = self.attend(
            qkv,
            past_key,
            past_value,
            step.seqlens_k,
            step.total_len,
            step.cos,
            step.sin,
            step.positions,
            step.bias,
            step.query_lens,
            self.num_heads,
            self.num_kv_heads,
            self.scale,
            self.k_scale,
            self.v_scale,
        )
        return self.o_proj(out), present_key, present_value

    def _normalise_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """q and k of the packed q | k | v, each head RMS-normalised over head_dim."""
        q_width, k_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_width, k_width, k_width], dim=-1)
        heads = (*qkv.shape[:-1], -1, self.head_dim)
        q = self.q_norm(q.reshape(heads))[0].reshape(q.shape)
        k = self.k_norm(k.reshape(heads))[0].reshape(k.shape)
        return torch.cat([q, k, v], dim=-1)


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

    def forward(self, x, residual, step: StepAttention, past_key, past_value):
        """x: the previous layer's output, not yet added to `residual`, the running sum (None before the first
        layer, whose x is the embedding). Returns this layer's output and the running sum, kept apart the same way
        so each residual add is fused with the norm after it."""
        h, residual = self.input_layernorm(x, residual)
        attn_out, present_key, present_value = self.self_attn(h, step, past_key, past_value)
        h, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(h), residual, present_key, present_value


class Backbone(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, quant: QuantSpec | None, embedding_quant: QuantSpec | None
    ) -> None:
        super().__init__()
        if embedding_quant is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
            self.embed_tokens.weight.requires_grad_(False)
        else:
            self.embed_tokens = QuantizedEmbedding(config.vocab_size, config.hidden_size, dtype, embedding_quant)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, quant) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Inputs and outputs are those of the engine's step graph (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        quant: QuantSpec | None = None,
        quantize_lm_head: bool = False,
        max_positions: int | None = None,
        head_rows: int | None = None,
        embedding_quant: QuantSpec | None = None,
    ) -> None:
        """`head_rows`: the LM head's rows, where it computes only a share of the vocabulary (a tensor-parallel
        rank's; builder/tensor_parallel.py); default all of it. `embedding_quant`: the blocks the embedding table is
        stored in, unless it is the float LM head itself (tied, unquantized); None: float."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        # A quantized LM head is its own (quantized) copy even when tied.
        head_quant = quant if quantize_lm_head else None
        untied = not config.tie_word_embeddings or head_quant is not None
        self.model = Backbone(config, dtype, quant, embedding_quant if untied else None)
        rows = head_rows or config.vocab_size
        self.lm_head = make_linear(config.hidden_size, rows, False, dtype, head_quant) if untied else None
        # a tied quantized head with a quantized table is also that table (weights.load_model)
        self.embedding_from_head = False
        cos, sin = rotary_tables(config, max_positions or config.max_position_embeddings, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.dtype if self.model.layers[0].self_attn.k_scale is None else torch.int8

    def use_int8_kv_cache(self, scales: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """From now on the cache holds int8 with these (K, V) scales per layer, each [1, kv_heads, 1, head_dim]."""
        for layer, (k_scale, v_scale) in zip(self.model.layers, scales, strict=True):
            layer.self_attn.k_scale, layer.self_attn.v_scale = k_scale.float(), v_scale.float()

    def use_torch_ops(self) -> None:
        """Trace for the torch backends (AOTInductor, TensorRT) from now on: attention in plain torch ops writing the
        cache in place (plugins.attention.attend_in_place), residual add + norm in plain torch ops, quantized linears
        through the Triton kernel's op with block minimums inside it (plugins.blockwise_matmul, a triton_op, which
        the compilers take apart into its kernel), instead of the ops the ONNX engines lower to onnxruntime's
        kernels. No op defined in Python is left for a compiled package to call back into."""
        for layer in self.model.layers:
            layer.self_attn.attend = attend_in_place
        for module in self.modules():
            if isinstance(module, QuantizedLinear):
                module.fused_kernel = True
            elif isinstance(module, RMSNorm):
                module.add_and_norm = add_then_rms_norm

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64: rotary positions (a tree node's depth after the cache)
        past_lens: torch.Tensor,  # [B] int64: valid cached positions per row; new token t goes to past_lens + t
        query_lens: torch.Tensor,  # [B] int64: real new tokens per row (the rest is padding); 0: the row is idle
        attention_bias: torch.Tensor,  # [B, 1, T, max(past_lens) + T] float32: 0 = attend, float32 min = masked
        logits_index: torch.Tensor,  # [B, N] int64: which of the T new tokens get logits
        past_keys: list[torch.Tensor],  # per layer [B, kv_heads, L, head_dim], of kv_cache_dtype
        past_values: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        """-> logits [B, N, vocab] float32, argmax [B, N] int64, hidden [B, N, hidden] float32 (final-normed),
        present_key.i..., present_value.i..."""
        batch, steps = input_ids.shape
        step = StepAttention(
            # an idle row with an empty cache counts as holding one position (the kernel wants seqlens_k >= 0)
            seqlens_k=(past_lens + query_lens - 1).clamp(min=0).to(torch.int32),
            total_len=(past_lens.max() + steps).to(torch.int32),
            positions=positions,
            bias=attention_bias.to(self.dtype),
            query_lens=query_lens.to(torch.int32),
            cos=self.rope_cos,
            sin=self.rope_sin,
        )
        if self.embedding_from_head:
            x, residual = self.lm_head.rows(input_ids).to(self.dtype), None
        else:
            x, residual = self.model.embed_tokens(input_ids), None
        present_keys, present_values = [], []
        for layer, past_key, past_value in zip(self.model.layers, past_keys, past_values):
            x, residual, present_key, present_value = layer(x, residual, step, past_key, past_value)
            present_keys.append(present_key)
            present_values.append(present_value)

        index = logits_index.unsqueeze(-1).expand(batch, logits_index.shape[1], x.shape[-1])
        hidden, _ = self.model.norm(torch.gather(x, 1, index), torch.gather(residual, 1, index))
        if self.lm_head is None:
            logits = hidden @ self.model.embed_tokens.weight.t()
        else:
            logits = self.lm_head(hidden)
        # The argmax is greedy decoding's token wherever nothing adjusts the logits: with it a plain greedy step
        # needs no sampler call (docs/measurements.md), and a draft model drafts inside its graph.
        logits = logits.float()
        return (logits, logits.argmax(-1), hidden.float(), *present_keys, *present_values)
