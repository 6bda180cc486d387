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
    "mqa": {"num_key_value_heads": 1, "tie_word_embeddings": False},
    "untied_bias": {"tie_word_embeddings": False, "attention_bias": True},
    "rope_scaling": {
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "odd": {"hidden_size": 40, "num_attention_heads": 5, "num_key_value_heads": 5, "intermediate_size": 72,
            "num_hidden_layers": 3},
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
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    config = transformers.LlamaConfig(**{**base, **CONFIGS[name]})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random init is too flat to tell positions apart: widen the weights
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.25)
            elif "bias" in str(param):
                param.normal_(0.0, 0.1)
    directory.mkdir(parents=True, exist_ok=True)
    max_shard = None if shards == 1 else f"{max(1, sum(p.numel() * 4 for p in model.parameters()) // shards // 1000 + 1)}KB"
    model.save_pretrained(directory, safe_serialization=True, **({"max_shard_size": max_shard} if max_shard else {}))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"})
    )
    return directory
