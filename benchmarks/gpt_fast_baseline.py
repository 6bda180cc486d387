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
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.heads
        self.eps = config["rms_norm_eps"]
        any_weight = weights["model.embed_tokens.weight"]
        shape = (self.layers, batch, self.kv_heads, max_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=any_weight.dtype, device=any_weight.device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=any_weight.dtype, device=any_weight.device))
        theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]  # (transformers 5 nests it)
        inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, device=any_weight.device) / self.head_dim)
        angles = torch.arange(max_len, device=any_weight.device)[:, None].float() * inv_freq[None]
        self.register_buffer("cos", angles.cos().to(any_weight.dtype))
        self.register_buffer("sin", angles.sin().to(any_weight.dtype))

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
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])  # tied embeddings have no lm_head
        return (self.norm(x[:, -1], w["model.norm.weight"]) @ head.t()).float()


def time_decode(
    checkpoint: Path,
    prompt: list[int],
    batch: int,
    new_tokens: int,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    compile_mode: str | None = "reduce-overhead",
) -> dict:
    """Greedy decode of `prompt` in `batch` rows: decode tokens/s (summed over rows), the prompt's prefill time
    (eager), and row 0's tokens. `compile_mode` None runs the decode step eagerly."""
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    weights = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        weights.update({k: v.to(device, dtype) for k, v in load_file(str(path)).items()})
    model = StaticCacheLlama(weights, config, batch, len(prompt) + new_tokens + 4)
    step = model.forward if compile_mode is None else torch.compile(model.forward, mode=compile_mode, fullgraph=True)
    tokens = torch.tensor([prompt] * batch, device=device)
    positions = torch.arange(len(prompt), device=device).expand(batch, -1)

    def synchronize():
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        model(tokens, positions)  # warm-up; the timed prefill below writes the same cache positions again
        synchronize()
        start = time.perf_counter()
        token = model(tokens, positions).argmax(-1, keepdim=True)
        synchronize()
        prefill_s = time.perf_counter() - start
        generated = [token]
        # the first steps compile (and record the CUDA graph); they are the first tokens, not timed
        warm = min(3, new_tokens)
        for i in range(warm):
            token = step(token, torch.full((batch, 1), len(prompt) + i, device=device)).argmax(-1, keepdim=True)
            generated.append(token)
        synchronize()
        start = time.perf_counter()
        for i in range(warm, new_tokens - 1):
            token = step(token, torch.full((batch, 1), len(prompt) + i, device=device)).argmax(-1, keepdim=True)
            generated.append(token)
        synchronize()
        seconds = time.perf_counter() - start
    timed = new_tokens - 1 - warm
    return {
        "batch": batch,
        "decode_tok_s": round(batch * timed / seconds, 1) if timed else None,
        "prefill_s": round(prefill_s, 4),
        "tokens": torch.cat(generated, dim=1)[0].tolist(),
    }
