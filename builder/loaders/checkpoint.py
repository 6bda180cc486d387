"""What every loader returns."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engines.model_config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint that cannot be built: missing file, malformed config, unsupported architecture."""


@dataclass(frozen=True)
class TokenizerSpec:
    tokenizer_json: str  # a `tokenizers` library serialisation
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool


@dataclass(frozen=True)
class Checkpoint:
    source: str
    format: str  # "hf" | "gguf"
    config: ModelConfig
    tokenizer: TokenizerSpec
    # (HF name, tensor), one at a time; tensors named in `keep` come as they are stored (BlockQuantized) if they
    # are in `block_formats`, every other tensor as float
    read_tensors: Callable[..., Iterator[tuple[str, Any]]]
    block_formats: dict[str, str] = field(default_factory=dict)  # HF name -> GGUF type, for exactly mappable blocks
    weight_types: dict[str, str] = field(default_factory=dict)  # HF name -> GGUF type of every 2-D weight (GGUF)
    # the sampling parameters the model's makers recommend (generation_config.json, a GGUF's general.sampling.*), by
    # SamplingParams' names: the runner's defaults for what a request does not set (vLLM's --generation-config auto)
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
