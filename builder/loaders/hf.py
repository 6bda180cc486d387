"""Hugging Face checkpoint directory: config.json + *.safetensors (single or sharded) + tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from builder.loaders.checkpoint import Checkpoint, CheckpointError, TokenizerSpec
from engines.model_config import ModelConfig, RopeScaling

# Llama and the models that are Llama but for biases, a sliding window or per-head q/k norms (same layer names)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"missing file: {path}") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"malformed JSON in {path}: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"malformed {path}: expected a JSON object")
    return data


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 nests rope settings under rope_parameters; older configs use rope_theta + rope_scaling.
    params = hf.get("rope_parameters") or {}
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def config_from_hf(hf: dict[str, Any], source: Path, generation: dict[str, Any] | None = None) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = ", ".join(hf.get("architectures") or []) or "unknown"
        raise CheckpointError(
            f"unsupported architecture in {source}: model_type={model_type!r} ({archs}); supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        theta, scaling = _rope(hf)
        eos = _eos_ids((generation or {}).get("eos_token_id", hf.get("eos_token_id")))
        # Qwen2 always biases q, k and v (its config has no attention_bias), never o_proj; Llama's flag covers all four
        qkv_bias = model_type == "qwen2" or bool(hf.get("attention_bias", False))
        window = hf.get("sliding_window") if model_type == "mistral" or hf.get("use_sliding_window") else None
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            o_proj_bias=model_type != "qwen2" and qkv_bias,
            sliding_window=None if window is None else int(window),
            qk_norm=model_type == "qwen3",
            rope_scaling=scaling,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
        )
    except KeyError as err:
        raise CheckpointError(f"malformed config in {source}: missing {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"malformed config in {source}: {err}") from None


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _tokenizer(directory: Path) -> TokenizerSpec:
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CheckpointError(f"missing file: {tokenizer_file} (only fast tokenizers are supported)")
    tok_config_path = directory / "tokenizer_config.json"
    tok_config = _read_json(tok_config_path) if tok_config_path.is_file() else {}
    template = tok_config.get("chat_template")
    template_file = directory / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text()
    return TokenizerSpec(
        tokenizer_json=tokenizer_file.read_text(),
        chat_template=template,
        bos_token=_token_text(tok_config.get("bos_token")),
        eos_token=_token_text(tok_config.get("eos_token")),
        add_bos_token=bool(tok_config.get("add_bos_token", False)),
    )


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"malformed {index}: no weight_map")
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {directory}")
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"missing file: {file}")
    return files


def load_hf_directory(directory: Path) -> Checkpoint:
    hf = _read_json(directory / "config.json")
    generation_path = directory / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else None
    config = config_from_hf(hf, directory, generation)
    tokenizer = _tokenizer(directory)
    files = _safetensors_files(directory)

    def read_tensors(keep: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        del keep  # safetensors hold no block-quantized tensors: everything comes as stored
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():
                        yield name, handle.get_tensor(name)
            except (OSError, ValueError, SafetensorError) as err:
                raise CheckpointError(f"cannot read {file}: {err}") from None

    return Checkpoint(
        str(directory), "hf", config, tokenizer, read_tensors, sampling_defaults=sampling_defaults(generation or {})
    )


# generation_config.json's sampling fields (SamplingParams' names) and the values transformers takes when a field is
# absent: vLLM reads the file as transformers' non-default values, so a field set to its default is not a default
GENERATION_FIELDS = {
    "temperature": ("temperature", 1.0),
    "top_k": ("top_k", 50),
    "top_p": ("top_p", 1.0),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None),
}


def sampling_defaults(generation: dict[str, Any]) -> dict[str, float | int]:
    """The sampling parameters a generation_config.json recommends, as vLLM's --generation-config auto reads them."""
    defaults = {}
    for key, (name, transformers_default) in GENERATION_FIELDS.items():
        value = generation.get(key)
        if value is not None and value != transformers_default:
            defaults[name] = value
    return defaults
