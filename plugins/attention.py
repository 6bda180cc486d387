"""Attention over the runner-owned KV cache as one fused op: rotary embedding, grouped-query attention, and the new
tokens' K/V written into the cache in place.

One op, in one place:
- `torch.ops.plugins.group_query_attention`: the reference (plain torch: rotary, scatter into a copy of the cache,
  masked softmax attention) used for eager runs and tests, and a fake kernel for torch.export;
- `onnx_translations`: its lowering to com.microsoft::GroupQueryAttention, the fused kernel onnxruntime runs
  natively (CPU and CUDA), one node per layer instead of ~25 small ones.

The contract (that of the onnxruntime kernel with right-padded query chunks, so the two agree by construction):
    qkv            [B, T, (heads + 2 * kv_heads) * head_dim]   the fused projection's output, q | k | v
    past_key/value [B, kv_heads, L, head_dim]                 the cache buffer rows; L is the buffer's length
    seqlens_k      [B] int32                                  P_b + Q_b - 1: row b holds P_b positions, adds Q_b
    total_len      [] int32                                   an upper bound of P_b + T (the bias's width)
    cos/sin_cache  [positions, head_dim / 2]                  rotary tables
    position_ids   [B, T] int64                               each new token's rotary position (tree depth)
    attention_bias [B, 1, T, total_len]                       added to the scores (tree masks; 0 elsewhere)
    query_lens     [B] int32                                  Q_b: tokens 0..Q_b-1 of row b are real, the rest
                                                              padding; Q_b = 0: the row takes no part
    k_scale/v_scale [1, kv_heads, 1, head_dim] or None        an int8 cache: static per-channel scales; a position
                                                              holds round(x / scale) clamped to -128..127, read
                                                              back as int8 * scale (new tokens included)
  -> out [B, T, heads * head_dim] (rows of padding tokens unspecified), present_key/value: the cache with real
     token t of row b written at P_b + t, nothing else changed.
Real token t of row b attends to positions 0..P_b + t (causal over cache and new tokens) plus the bias. With past
and present bound to the same buffer (IO binding) onnxruntime writes the new K/V in place and reads only the first
P_b + Q_b positions of each row: a step costs what the rows hold, not what the buffer could hold. The kernel needs
P_b + T <= L for every row (room for the padded chunk) and head_dim a multiple of 16.
"""

from __future__ import annotations

import torch

from plugins.onnx_schema import register_contrib_op

HEAD_DIM_MULTIPLE = 16  # onnxruntime's CPU kernel refuses other head sizes


def check_head_dim(head_dim: int) -> None:
    if head_dim % HEAD_DIM_MULTIPLE:
        raise ValueError(
            f"head_dim {head_dim} is not a multiple of {HEAD_DIM_MULTIPLE}, which onnxruntime's fused attention "
            "(com.microsoft::GroupQueryAttention) requires; Llama-family models use 64 or 128"
        )


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves layout (Hugging Face's rotate_half): x [..., D], cos/sin [..., D/2]."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


INT8_CACHE_MAX = 127  # calibration maps the largest |x| seen to 127; the kernel saturates to int8's own range


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """New K or V [..., kv_heads, head_dim] as the cache stores them."""
    if scale is None:
        return x.to(cache_dtype)
    per_channel = scale.reshape(scale.shape[1], scale.shape[3])  # [kv_heads, head_dim]
    return torch.round(x.float() / per_channel).clamp(-128, 127).to(torch.int8)


def from_cache(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A cache buffer [B, kv_heads, L, head_dim] as the values attention reads."""
    return cache.float() if scale is None else cache.float() * scale


@torch.library.custom_op("plugins::group_query_attention", mutates_args=())
def group_query_attention(
    qkv: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_len: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    position_ids: torch.Tensor,
    attention_bias: torch.Tensor,
    query_lens: torch.Tensor,
    num_heads: int,
    kv_heads: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference (eager runs and tests only; the engine runs onnxruntime's fused kernel)."""
    batch, steps, _ = qkv.shape
    head_dim = past_key.shape[-1]
    length = past_key.shape[2]
    x = qkv.float().view(batch, steps, num_heads + 2 * kv_heads, head_dim)
    cos, sin = cos_cache.float()[position_ids].unsqueeze(2), sin_cache.float()[position_ids].unsqueeze(2)
    q = rotate(x[:, :, :num_heads], cos, sin).transpose(1, 2)  # [B, heads, T, D]
    k = rotate(x[:, :, num_heads : num_heads + kv_heads], cos, sin)  # [B, T, kv_heads, D]
    v = x[:, :, num_heads + kv_heads :]

    past = seqlens_k.long() + 1 - query_lens.long()  # [B]
    slots = past.unsqueeze(1) + torch.arange(steps)  # [B, T]: each new token's position
    real = torch.arange(steps) < query_lens.long().unsqueeze(1)  # [B, T]: padding tokens stay out of the cache
    rows = torch.arange(batch).unsqueeze(1).expand(batch, steps)
    present_key, present_value = past_key.clone(), past_value.clone()
    present_key.transpose(1, 2)[rows[real], slots[real]] = to_cache(k[real], past_key.dtype, k_scale)
    present_value.transpose(1, 2)[rows[real], slots[real]] = to_cache(v[real], past_value.dtype, v_scale)

    group = num_heads // kv_heads
    keys = from_cache(present_key, k_scale).repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    values = from_cache(present_value, v_scale).repeat_interleave(group, dim=1)
    scores = (q @ keys.transpose(-1, -2)) * scale  # [B, heads, T, L]
    bias = torch.zeros(batch, 1, steps, length)
    bias[..., : attention_bias.shape[-1]] = attention_bias.float()
    allowed = torch.arange(length) <= slots.unsqueeze(-1)  # [B, T, L]: causal over cache + new tokens
    scores = (scores + bias).masked_fill(~allowed.unsqueeze(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values  # [B, heads, T, D]
    return out.transpose(1, 2).reshape(batch, steps, num_heads * head_dim).to(qkv.dtype), present_key, present_value


@group_query_attention.register_fake
def _(
    qkv,
    past_key,
    past_value,
    seqlens_k,
    total_len,
    cos_cache,
    sin_cache,
    position_ids,
    attention_bias,
    query_lens,
    num_heads,
    kv_heads,
    scale,
    k_scale=None,
    v_scale=None,
):
    head_dim = past_key.shape[-1]
    return qkv.new_empty(*qkv.shape[:2], num_heads * head_dim), torch.empty_like(past_key), torch.empty_like(past_value)


def attend_in_place(
    qkv: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_len: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    position_ids: torch.Tensor,
    attention_bias: torch.Tensor,
    query_lens: torch.Tensor,
    num_heads: int,
    kv_heads: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`group_query_attention`'s contract in plain torch ops, for the torch backends (AOTInductor, TensorRT's ONNX):
    the new K/V are written into `past_key` / `past_value` themselves, which torch.export records as a mutation of
    those inputs and AOTInductor performs on the runner's buffers, and the same tensors come back as present_*.

    Computes in the model's dtype over the positions the bias spans (max(past_lens) + T: a step costs what its rows
    hold, not what the buffer could hold; a caller may pad the bias wider with zeros, since causality masks what
    lies past each token), with the query heads of one KV head stacked along the token axis, so the cache is read
    as it is, never repeated per query head. Padding tokens write back what their slot held, so they change
    nothing."""
    batch, steps, _ = qkv.shape
    head_dim, length = past_key.shape[-1], past_key.shape[2]
    dtype, device = qkv.dtype, qkv.device
    x = qkv.view(batch, steps, num_heads + 2 * kv_heads, head_dim)
    cos, sin = cos_cache[position_ids].unsqueeze(2), sin_cache[position_ids].unsqueeze(2)
    q = rotate(x[:, :, :num_heads], cos, sin)  # [B, T, heads, D]
    k = rotate(x[:, :, num_heads : num_heads + kv_heads], cos, sin)  # [B, T, kv_heads, D]
    v = x[:, :, num_heads + kv_heads :]

    past = seqlens_k.long() + 1 - query_lens.long()
    slots = past.unsqueeze(1) + torch.arange(steps, device=device)  # [B, T]
    real = (torch.arange(steps, device=device) < query_lens.long().unsqueeze(1))[..., None, None]
    written = slots.clamp(max=length - 1)
    rows = torch.arange(batch, device=device).unsqueeze(1).expand(batch, steps)
    for cache, new, cache_scale in ((past_key, k, k_scale), (past_value, v, v_scale)):
        cache[rows, :, written] = torch.where(real, to_cache(new, cache.dtype, cache_scale), cache[rows, :, written])

    group, attended = num_heads // kv_heads, attention_bias.shape[-1]
    keys, values = past_key[:, :, :attended], past_value[:, :, :attended]
    keys = from_cache(keys, k_scale).to(dtype) if k_scale is not None else keys
    values = from_cache(values, v_scale).to(dtype) if v_scale is not None else values
    queries = q.transpose(1, 2).reshape(batch, kv_heads, group * steps, head_dim)  # query head h reads h // group
    allowed = torch.arange(attended, device=device) <= slots.unsqueeze(-1)  # [B, T, A]
    mask = attention_bias.float().masked_fill(~allowed.unsqueeze(1), float("-inf")).repeat(1, 1, group, 1)
    # explicit softmax attention: scaled_dot_product_attention's CPU kernel leaves strides that pin the token
    # count in torch.export; the scores are [B, kv_heads, group * T, A], which a decode step keeps small
    scores = (queries @ keys.transpose(-1, -2)).float() * scale + mask
    out = torch.softmax(scores, dim=-1).to(dtype) @ values  # [B, kv_heads, group * T, D]
    out = out.unflatten(2, (group, steps)).flatten(1, 2).transpose(1, 2).flatten(2)
    return out, past_key, past_value


def _register_schema() -> None:
    optional = ["key?:T", "value?:T", "past_key?:T_CACHE", "past_value?:T_CACHE"]
    rotary = ["cos_cache?:T", "sin_cache?:T", "position_ids?:tensor(int64)", "attention_bias?:T", "head_sink?:T"]
    scales = ["k_scale?:T_KV_SCALE", "v_scale?:T_KV_SCALE"]
    unused = [f"{n}?:T" for n in ("q_norm_weight", "k_norm_weight")]
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    register_contrib_op(
        "GroupQueryAttention",
        inputs=[
            "query:T",
            *optional,
            "seqlens_k:M",
            "total_sequence_length:M",
            *rotary,
            *scales,
            *unused,
            "query_seqlens?:M",
        ],
        outputs=["output:T", "present_key:T_CACHE", "present_value:T_CACHE"],
        types={
            "T": floats,
            "T_CACHE": [*floats, "tensor(int8)"],
            "T_KV_SCALE": ["tensor(float)"],
            "M": ["tensor(int32)"],
        },
        attributes={
            "num_heads": int,
            "kv_num_heads": int,
            "do_rotary": int,
            "rotary_interleaved": int,
            "scale": float,
            "k_quant_type": str,
            "v_quant_type": str,
            "kv_cache_bit_width": int,
        },
    )


def onnx_translations() -> dict:
    """custom_translation_table entries for torch.onnx.export."""
    import onnxscript

    _register_schema()
    microsoft = onnxscript.values.Opset("com.microsoft", 1)

    def group_query_attention_to_onnx(
        qkv,
        past_key,
        past_value,
        seqlens_k,
        total_len,
        cos_cache,
        sin_cache,
        position_ids,
        attention_bias,
        query_lens,
        num_heads: int,
        kv_heads: int,
        scale: float,
        k_scale=None,
        v_scale=None,
    ):
        # an int8 cache: onnxruntime's kernel quantizes new K/V with the static per-channel scales and reads the
        # cache back through them (its kv_cache_bit_width / *_quant_type attributes)
        int8_cache = (
            {}
            if k_scale is None
            else dict(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
        )
        return microsoft.GroupQueryAttention(
            qkv,
            None,
            None,
            past_key,
            past_value,
            seqlens_k,
            total_len,
            cos_cache,
            sin_cache,
            position_ids,
            attention_bias,
            None,
            k_scale,
            v_scale,
            None,
            None,
            query_lens,  # no head_sink, q/k norms
            num_heads=num_heads,
            kv_num_heads=kv_heads,
            scale=scale,
            do_rotary=1,
            rotary_interleaved=0,
            **int8_cache,
        )

    return {torch.ops.plugins.group_query_attention.default: group_query_attention_to_onnx}
