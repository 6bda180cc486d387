"""The anchor for GPU decode speed: a Llama in plain PyTorch with a static KV cache, its decode step compiled by
torch.compile (mode "reduce-overhead": CUDA graphs), in the style of gpt-fast. It reads the same Hugging Face
safetensors as `builder build`, so scripts/device_check.py times both on the same weights."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F


class StaticCacheLlama(torch.nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor], config: dict, batch: int, max_len: int) -> None:
        super().__init__()
        self.w = weights
        self.layers = config["num_hidden_layers"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config["hidden_size"] // self.heads
        self.eps = config["rms_norm_eps"]
        any_weight = weights["model.embed_tokens.weight"]
        shape = (self.layers, batch, self.kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=any_weight.dtype, device=any_weight.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        inv_freq = 1.0 / config["rope_theta"] ** (
            torch.arange(0, self.head_dim, 2, device=any_weight.device) / self.head_dim
        )
        angles = torch.arange(max_len, device=any_weight.device)[:, None].float() * inv_freq[None]
        self.cos, self.sin = angles.cos().to(any_weight.dtype), angles.sin().to(any_weight.dtype)

    def norm(self, x, weight):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * weight

    def rotate(self, x, pos):
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]
        first, second = x.chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] at positions pos [B, T] (every row at the same positions) -> logits of the last token."""
        w, (batch, steps) = self.w, tokens.shape
        x = F.embedding(tokens, w["model.embed_tokens.weight"])
        mask = torch.arange(self.k_cache.shape[3], device=x.device)[None, :] <= pos[0][:, None]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            h = self.norm(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].t()).view(batch, steps, self.heads, self.head_dim)
            k = (h @ w[p + "self_attn.k_proj.weight"].t()).view(batch, steps, self.kv_heads, self.head_dim)
            v = (h @ w[p + "self_attn.v_proj.weight"].t()).view(batch, steps, self.kv_heads, self.head_dim)
            q, k = self.rotate(q, pos).transpose(1, 2), self.rotate(k, pos).transpose(1, 2)
            self.k_cache[i].index_copy_(2, pos[0], k)
            self.v_cache[i].index_copy_(2, pos[0], v.transpose(1, 2))
            out = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask, enable_gqa=True)
            x = x + out.transpose(1, 2).reshape(batch, steps, -1) @ w[p + "self_attn.o_proj.weight"].t()
            h = self.norm(x, w[p + "post_attention_layernorm.weight"])
            gate, up = h @ w[p + "mlp.gate_proj.weight"].t(), h @ w[p + "mlp.up_proj.weight"].t()
            x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].t()
        return self.norm(x[:, -1], w["model.norm.weight"]) @ w["lm_head.weight"].t()


def time_decode(checkpoint: Path, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Decode tokens/s (summed over rows) and the prompt's prefill time, greedy, bf16, on CUDA."""
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    weights = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        weights.update({k: v.to("cuda", torch.bfloat16) for k, v in load_file(str(path)).items()})
    model = StaticCacheLlama(weights, config, batch, prompt_len + new_tokens + 1)
    step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    prompt = torch.randint(0, config["vocab_size"], (batch, prompt_len), device="cuda")
    with torch.inference_mode():
        prefill_positions = torch.arange(prompt_len, device="cuda").expand(batch, -1)
        model(prompt, prefill_positions)  # eager prefill (warm-up), then timed
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = model(prompt, prefill_positions)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - start
        token = logits.argmax(-1, keepdim=True)
        for warm in range(3):  # compiles and records the CUDA graph
            step(token, torch.full((batch, 1), prompt_len + warm, device="cuda")).argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(new_tokens):
            token = step(token, torch.full((batch, 1), prompt_len + i, device="cuda")).argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return {"batch": batch, "decode_tok_s": batch * new_tokens / seconds, "prefill_s": prefill_s}
