"""Checkpoint loaders: a Hugging Face directory, a GGUF file, or the embedded default model.

Every loader returns a `Checkpoint`: the model config, the tokenizer, and a lazy iterator over the weights under
Hugging Face names, one tensor at a time, so no caller ever needs the whole model in memory.
"""

from __future__ import annotations

from pathlib import Path

from builder.loaders.checkpoint import Checkpoint, CheckpointError, TokenizerSpec
from builder.loaders.default import DEFAULT_MODEL_NAME, default_gguf_path
from builder.loaders.gguf_file import load_gguf
from builder.loaders.hf import load_hf_directory

__all__ = ["Checkpoint", "CheckpointError", "TokenizerSpec", "load_checkpoint"]


def load_checkpoint(source: str | Path) -> Checkpoint:
    """Open `source`: "default", a Hugging Face checkpoint directory, or a .gguf file."""
    if str(source) == DEFAULT_MODEL_NAME:
        return load_gguf(default_gguf_path())
    path = Path(source)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        return load_hf_directory(path)
    if path.suffix == ".gguf":
        return load_gguf(path)
    raise CheckpointError(f"{path} is neither a checkpoint directory nor a .gguf file")
