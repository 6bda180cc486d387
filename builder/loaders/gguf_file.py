"""GGUF file (llama.cpp): weights dequantized tensor by tensor, tokenizer and chat template from the metadata."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from builder.loaders.checkpoint import Checkpoint, CheckpointError, TokenizerSpec
from builder.loaders.gguf_blocks import EXACT_FORMS, BlockQuantized
from engines.model_config import ModelConfig

# GGUF tensor name -> Hugging Face name ("{}" is the layer index).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_CONTROL_TOKEN = 3


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time Q/K row permutation (interleaved rotary pairs -> halves, as in HF)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


class _Metadata:
    def __init__(self, reader: Any, path: Path) -> None:
        self._reader = reader
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"malformed GGUF {self._path}: missing metadata {key!r}")
        return value


# GGUF architectures with Llama's layers; llama.cpp's converter permutes Q/K rows for llama only (Mistral's GGUFs are
# "llama" too), and keys its metadata by the architecture's name
ARCHITECTURES = ("llama", "qwen2", "qwen3")


def _config(meta: _Metadata, tensor_names: set[str], path: Path) -> ModelConfig:
    arch = meta.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"unsupported architecture in {path}: {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    heads = int(meta.require(f"{arch}.attention.head_count"))
    hidden = int(meta.require(f"{arch}.embedding_length"))
    tokens = meta.require("tokenizer.ggml.tokens")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(meta.get(f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(meta.require(f"{arch}.feed_forward_length")),
        num_layers=int(meta.require(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        # llama.cpp writes the head size as attention.key_length where it is not hidden / heads (Qwen3: 128)
        head_dim=int(
            meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count", hidden // heads)
        ),
        rms_norm_eps=float(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        o_proj_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2 splits every digit off (its tokenizer.json's)


def _pre_tokenizer(kind: str, path: Path):
    """The text splitting llama.cpp's `tokenizer.ggml.pre` names, for the kinds we know to be exact."""
    from tokenizers import Regex, pre_tokenizers

    if kind in ("default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if kind == "smollm":
        # GPT-2's split with every digit on its own, as in SmolLM's own tokenizer.json.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    splits = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
    if kind in splits:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(splits[kind]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise CheckpointError(f"unsupported GGUF pre-tokenizer {kind!r} in {path}; supported: gpt2, smollm, llama3, qwen2")


def _tokenizer(meta: _Metadata, path: Path) -> TokenizerSpec:
    from tokenizers import AddedToken, Tokenizer, decoders, models

    kind = meta.require("tokenizer.ggml.model")
    tokens = meta.require("tokenizer.ggml.tokens")
    if kind == "gpt2":
        merges = [tuple(merge.split(" ", 1)) for merge in meta.require("tokenizer.ggml.merges")]
        tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), path)
        tokenizer.decoder = decoders.ByteLevel()
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(
            tokens,
            meta.require("tokenizer.ggml.scores"),
            meta.get("tokenizer.ggml.unknown_token_id"),
            bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        )
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))  # llama.cpp's default for these
    else:
        raise CheckpointError(
            f"unsupported GGUF tokenizer {kind!r} in {path}; supported: gpt2 (byte-level BPE), "
            "llama (SentencePiece BPE)"
        )
    types = meta.get("tokenizer.ggml.token_type") or []
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == _CONTROL_TOKEN]
    )

    def token(key: str) -> str | None:
        index = meta.get(key)
        return None if index is None else tokens[int(index)]

    return TokenizerSpec(
        tokenizer_json=tokenizer.to_str(),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        add_bos_token=add_bos,
    )


def _sentencepiece_bpe(tokens: list[str], scores: list[float], unknown: int | None, space_prefix: bool):
    """A SentencePiece BPE vocabulary (Llama 2, Mistral, TinyLlama GGUFs: "▁" for spaces, <0xNN> byte tokens) as the
    `tokenizers` library runs it, the way transformers' LlamaTokenizer does: BPE with byte fallback over merges
    recovered from the scores (SentencePiece merges the pair whose merged piece scores highest first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        merges += [(score, left, right) for left, right in sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    merges.sort(key=lambda merge: -merge[0])  # stable: ties keep the vocabulary's order
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for _, left, right in merges],
            unk_token=None if unknown is None else tokens[int(unknown)],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", split=False, prepend_scheme="first" if space_prefix else "never"
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return tokenizer


def load_gguf(path: Path) -> Checkpoint:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as err:
        raise CheckpointError(f"cannot read GGUF file {path}: {err}") from None
    meta = _Metadata(reader, path)
    tensor_names = {t.name for t in reader.tensors}
    config = _config(meta, tensor_names, path)
    tokenizer = _tokenizer(meta, path)
    permuted = meta.require("general.architecture") == "llama"

    def read_tensors(keep: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor | BlockQuantized]]:
        for tensor in reader.tensors:
            name = hf_tensor_name(tensor.name)
            if name is None:
                continue
            shape = [int(n) for n in reversed(tensor.shape)]
            # kept blocks stay raw bytes, one row per output feature: the Q/K row permutation applies to them as is
            if name in keep:
                data = np.asarray(tensor.data)
            else:
                data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            if permuted and (name.endswith("q_proj.weight") or name.endswith("q_proj.bias")):
                data = unpermute_rows(data, config.num_heads)
            elif permuted and (name.endswith("k_proj.weight") or name.endswith("k_proj.bias")):
                data = unpermute_rows(data, config.num_kv_heads)
            if name in keep:
                yield name, BlockQuantized(tensor.tensor_type.name, np.ascontiguousarray(data), shape[1])
            else:
                yield name, torch.from_numpy(np.array(data, dtype=np.float32))

    weight_types = {
        name: t.tensor_type.name
        for t in reader.tensors
        if (name := hf_tensor_name(t.name)) is not None and len(t.shape) == 2
    }
    block_formats = {name: kind for name, kind in weight_types.items() if kind in EXACT_FORMS}
    defaults = {name: meta.get(f"general.sampling.{key}") for key, name in GGUF_SAMPLING.items()}
    return Checkpoint(
        str(path),
        "gguf",
        config,
        tokenizer,
        read_tensors,
        block_formats,
        weight_types,
        {
            name: float(f"{value:.6g}") if isinstance(value, float) else value  # (stored as float32)
            for name, value in defaults.items()
            if value is not None
        },
    )


# a GGUF's recommended sampling (llama.cpp's general.sampling.* keys) by SamplingParams' names; penalty_last_n (the
# window llama.cpp's repeat penalty looks back over) has no counterpart: vLLM's penalty covers prompt and output
GGUF_SAMPLING = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}
