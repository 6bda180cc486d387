"""Small random Llama checkpoints in the Hugging Face layout, made by transformers itself (the reference)."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Engines compile graphs ahead of time; runners batch requests. "
    "Speculative decoding drafts tokens and verifies them in one pass. 0123456789 hello world, hello engine!"
)

# name -> overrides of the base config
CONFIGS = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    # 3 KV heads of 2 query heads each: split 2 + 1 over two ranks (the default model's 9 / 3 are split so)
    "three_kv_heads": {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
    "mqa": {"num_key_value_heads": 1, "tie_word_embeddings": False},
    "untied_bias": {"tie_word_embeddings": False, "attention_bias": True},
    "rope_scaling": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    # head_dim is set apart from hidden / heads: onnxruntime's fused attention needs a multiple of 16
    "odd": {
        "hidden_size": 40,
        "num_attention_heads": 5,
        "num_key_value_heads": 5,
        "head_dim": 16,
        "intermediate_size": 72,
        "num_hidden_layers": 3,
    },
    # Llama-shaped families transformers has its own classes for: Qwen2 biases q/k/v (not o_proj), Mistral has a
    # sliding window (here longer than any engine the tests build)
    "qwen2": {"model_type": "qwen2", "rope_theta": 1000000.0},
    "mistral": {"model_type": "mistral", "sliding_window": 4096, "tie_word_embeddings": False},
    # per-head q/k RMSNorm before the rotary embedding; head_dim 128 (its default)
    "qwen3": {"model_type": "qwen3", "rope_theta": 1000000.0},
    # every linear's inputs a multiple of 256, as GGUF K-quants need (llama.cpp falls back to Q5_0 / Q8_0 elsewhere)
    "k_quants": {"hidden_size": 256, "intermediate_size": 512},
}


def make_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS] * 4, trainer)
    return tokenizer


def make_checkpoint(directory: Path, name: str = "gqa", seed: int = 0, shards: int = 1) -> Path:
    import torch
    import transformers

    tokenizer = make_tokenizer(320)
    vocab = tokenizer.get_vocab_size()
    base = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    overrides = dict(CONFIGS[name])
    family = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[
        overrides.pop("model_type", "llama")
    ]
    config = getattr(transformers, f"{family}Config")(**{**base, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # random init is too flat to tell positions apart: widen the weights
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.25)
            elif name.endswith(".bias"):  # (transformers starts them at zero, which would test nothing)
                param.normal_(0.0, 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # (and these at one)
                param.normal_(1.0, 0.2)
    directory.mkdir(parents=True, exist_ok=True)
    max_shard = (
        None if shards == 1 else f"{max(1, sum(p.numel() * 4 for p in model.parameters()) // shards // 1000 + 1)}KB"
    )
    model.save_pretrained(directory, safe_serialization=True, **({"max_shard_size": max_shard} if max_shard else {}))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"})
    )
    return directory


def make_gguf(
    path: Path,
    checkpoint: Path,
    linear_type: str = "Q4_1",
    embedding_type: str = "Q8_0",
    sampling: dict[str, float] | None = None,
    arch: str = "llama",
    module_types: dict[str, str] | None = None,
) -> Path:
    """The tiny HF checkpoint written as llama.cpp would: GGUF names, Q/K rows permuted (for the llama architecture,
    as llama.cpp's converter does), linears, the embedding and an untied head block-quantized by gguf-py's own
    quantizer (the K-quants and IQ4_NL, which it lacks, by `quantize_q4_k`, `quantize_q5_k`, `quantize_q6_k`,
    `quantize_iq4_nl`), tokenizer and chat template
    in the metadata; `sampling`: general.sampling.* keys (float32 values; top_k int32); `module_types`: another
    type than `linear_type` for the linears of these modules (e.g. "mlp.down_proj")."""
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from builder.loaders import load_checkpoint

    config = load_checkpoint(checkpoint).config
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    weights = load_file(str(checkpoint / "model.safetensors"))
    heads, kv_heads = config.num_heads, config.num_kv_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if config.head_dim != config.hidden_size // heads:  # as llama.cpp's converter writes it (Qwen3)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    specials = {token["content"]: token["id"] for token in tokenizer["added_tokens"]}
    vocab = dict(vocab) | specials
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_token_types([3 if token in specials else 1 for token in tokens])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_ids[0])
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (sampling or {}).items():
        (writer.add_int32 if isinstance(value, int) else writer.add_float32)(f"general.sampling.{key}", value)

    def permute(weight: np.ndarray, n_heads: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf.py
        return (
            weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape)
        )

    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    }
    for name, tensor in weights.items():
        data = tensor.to(torch.float32).numpy()
        if name == "model.embed_tokens.weight":
            gguf_name, kind = "token_embd.weight", embedding_type
        elif name == "lm_head.weight":  # an untied head, in Q8_0 as llama.cpp's converter writes it at q8_0
            gguf_name, kind = "output.weight", "Q8_0"
        elif name == "model.norm.weight":
            gguf_name, kind = "output_norm.weight", "F32"
        else:
            _, _, layer, *rest = name.split(".")
            module = ".".join(rest[:-1])
            kind = (module_types or {}).get(module, linear_type) if data.ndim == 2 else "F32"
            gguf_name = f"blk.{layer}.{names[module]}.{rest[-1]}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                data = permute(data, heads if module == "self_attn.q_proj" else kv_heads)
        qtype = gguf.GGMLQuantizationType[kind]
        quantizers = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k, "IQ4_NL": quantize_iq4_nl}
        raw = quantizers[kind](data) if kind in quantizers else gguf.quants.quantize(data, qtype)
        writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantize_q4_k(weight):
    """Rows [N, K] (K a multiple of 256) in llama.cpp's Q4_K blocks, rounded to nearest: per 32 inputs a scale
    (max - min) / 15 and a minimum min(w, 0), each a 6-bit multiple of its super-block's float16 d / dmin (llama.cpp
    searches for better ones; the layout is what matters here). Returns uint8 [N, K / 256 x 144]."""
    return _k_quant_with_minimums(weight, 4)


def quantize_q5_k(weight):
    """Rows [N, K] (K a multiple of 256) in llama.cpp's Q5_K blocks: Q4_K's with 5-bit values, their fifth bits in
    32 bytes after the scales (byte i's bit s: input i of sub-block s). Returns uint8 [N, K / 256 x 176]."""
    return _k_quant_with_minimums(weight, 5)


def _k_quant_with_minimums(weight, bits: int):
    import numpy as np

    rows, columns = weight.shape
    top = (1 << bits) - 1
    sub = weight.astype(np.float32).reshape(rows, columns // 256, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - low) / top
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (-low.min(-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1).astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(-low / np.where(dmin > 0, dmin, 1).astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * m
    q = np.clip(np.rint((sub + offset[..., None]) / np.where(step > 0, step, 1)[..., None]), 0, top).astype(np.uint8)
    scales = np.concatenate(  # the inverse of llama.cpp's get_scale_min_k4
        (
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            m[..., :4] | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ),
        axis=-1,
    )
    pairs = q.reshape(rows, columns // 256, 4, 2, 32) & 15
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, columns // 256, 128)
    halves = np.stack((d, dmin), -1).view(np.uint8)
    high = [((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)] if bits == 5 else []
    return np.concatenate((halves, scales, *high, qs), axis=-1).reshape(rows, -1)


IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # llama.cpp's kvalues_iq4nl


def quantize_iq4_nl(weight):
    """Rows [N, K] (K a multiple of 32) in llama.cpp's IQ4_NL blocks, a type no engine layout holds: per 32 inputs a
    float16 d = max|w| / 127 and 16 bytes of nibbles (value j low, j + 16 high, as Q4_0) indexing a fixed table of
    16 levels, each the level nearest w / d. Returns uint8 [N, K / 32 x 18]."""
    import numpy as np

    rows, columns = weight.shape
    blocks = weight.astype(np.float32).reshape(rows, columns // 32, 32)
    d = (np.abs(blocks).max(-1) / 127).astype(np.float16)
    step = np.where(d > 0, d, 1).astype(np.float32)[..., None]
    levels = np.array(IQ4_NL_VALUES, np.float32)
    q = np.abs(blocks[..., None] / step[..., None] - levels).argmin(-1).astype(np.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return np.concatenate((d[..., None].view(np.uint8), nibbles), axis=-1).reshape(rows, -1)


def quantize_q6_k(weight):
    """Rows [N, K] (K a multiple of 256) in llama.cpp's Q6_K blocks, rounded to nearest: per 16 inputs a scale
    max|w| / 31, an int8 multiple of its super-block's float16 d; values q - 32 of 6 bits. Returns uint8
    [N, K / 256 x 210]: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (dequantize_row_q6_K's
    order)."""
    import numpy as np

    rows, columns = weight.shape
    supers = columns // 256
    sub = weight.astype(np.float32).reshape(rows, supers, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1).astype(np.float32)[..., None]), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[..., None] * sc
    q = np.clip(np.rint(sub / np.where(step != 0, step, 1)[..., None]), -32, 31) + 32
    values = q.astype(np.uint8).reshape(rows, supers, 2, 4, 32)  # [.., half, group of 32, i]
    low = values & 0x0F
    ql = np.concatenate((low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)), axis=-1)
    qh = sum((values[..., g, :] >> 4) << (2 * g) for g in range(4)).astype(np.uint8)
    blocks = (
        ql.reshape(rows, supers, 128),
        qh.reshape(rows, supers, 64),
        sc.view(np.uint8),
        d[..., None].view(np.uint8),
    )
    return np.concatenate(blocks, axis=-1).reshape(rows, -1)
