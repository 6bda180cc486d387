"""Shared fixtures: tiny random checkpoints and engines built from them once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.tiny_checkpoint import make_checkpoint

# Keep the suite predictable on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Triton kernels run in Triton's interpreter where there is no GPU (tests/plugins/test_blockwise_matmul.py); Triton
# reads this when a kernel is defined, so before anything imports plugins.blockwise_matmul.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def make(name: str = "gqa", shards: int = 1) -> Path:
        key = (name, shards)
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(f"ckpt_{name}"), name, shards=shards)
        return made[key]

    return make


@pytest.fixture(scope="session")
def engine_factory(tmp_path_factory, checkpoint_factory):
    from builder.build import BuildOptions, build_engine

    built: dict[tuple, Path] = {}

    def build(
        name: str = "gqa",
        max_seq_len: int = 256,
        max_batch: int = 4,
        prefill_chunk: int = 32,
        quant: str = "none",
        int8_compute: bool = True,
        draft_head: Path | None = None,
        beam_width: int = 3,
        draft_len: int = 4,
        speculative: str = "none",
        prompt_lookup_len: int = 4,
        draft_model: str | None = None,
        draft_quant: str | None = None,  # the build's default for the speculation method
        kv_cache_dtype: str = "auto",
        native_decode_attention: bool = True,
        native_quantized_matmul: bool = True,
        backend: str = "onnxruntime",
        tensor_parallel: int = 1,
        quantize_embedding: bool = True,
    ) -> Path:
        """An engine of a tiny checkpoint; a `draft_head` makes it a ReDrafter engine, a `draft_model` (a tiny
        checkpoint's name) a draft-model engine."""
        speculative = (
            "redrafter" if draft_head is not None else "draft-model" if draft_model is not None else speculative
        )
        key = (
            name,
            max_seq_len,
            max_batch,
            prefill_chunk,
            quant,
            int8_compute,
            draft_head,
            beam_width,
            draft_len,
            speculative,
            prompt_lookup_len,
            draft_model,
            draft_quant,
            kv_cache_dtype,
            native_decode_attention,
            native_quantized_matmul,
            backend,
            tensor_parallel,
            quantize_embedding,
        )
        if key not in built:
            out = tmp_path_factory.mktemp(f"engine_{name}") / "engine"
            speculation = dict(
                speculative=speculative,
                draft_head=draft_head,
                beam_width=beam_width,
                draft_len=draft_len,
                prompt_lookup_len=prompt_lookup_len,
                draft_quant=draft_quant,
                draft_model=None if draft_model is None else str(checkpoint_factory(draft_model)),
            )
            options = BuildOptions(
                str(checkpoint_factory(name)),
                out,
                "fp32",
                max_seq_len,
                max_batch,
                prefill_chunk,
                quant=quant,
                int8_compute=int8_compute,
                kv_cache_dtype=kv_cache_dtype,
                native_decode_attention=native_decode_attention,
                native_quantized_matmul=native_quantized_matmul,
                backend=backend,
                tensor_parallel=tensor_parallel,
                quantize_embedding=quantize_embedding,
                **speculation,
            )
            build_engine(options, log=lambda line: None)
            built[key] = out
        return built[key]

    return build


def prebuilt_engine(variable: str) -> Path:
    """An engine CI builds once (scripts/test.sh) and names in an environment variable. Elsewhere its tests skip
    where there is none; under CI (CI=true) a missing engine fails them, so a broken build cannot pass as skipped."""
    path = os.environ.get(variable)
    if not path or not (Path(path) / "manifest.json").is_file():
        message = f"{variable} does not point at a built engine (scripts/test.sh builds one)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return Path(path)


@pytest.fixture(scope="session")
def default_engine():
    """The engine of the default model."""
    return prebuilt_engine("DEFAULT_ENGINE_DIR")


@pytest.fixture(scope="session")
def default_gguf_engine():
    """The default model as the README's main job builds it: the GGUF's own Q4_1 / Q8_0 blocks (--quant auto)."""
    return prebuilt_engine("DEFAULT_GGUF_ENGINE_DIR")


@pytest.fixture(scope="session")
def default_redrafter_engine():
    """The default model with the shipped ReDrafter head."""
    return prebuilt_engine("DEFAULT_REDRAFTER_ENGINE_DIR")


@pytest.fixture(scope="session")
def tiny_draft_head(tmp_path_factory, engine_factory):
    """A draft head distilled from the tiny gqa engine's own answers (a few seconds: tiny prompts and model)."""
    from training.drafter import DrafterTrainingOptions, train_drafter

    out = tmp_path_factory.mktemp("drafter") / "head.safetensors"
    options = DrafterTrainingOptions(
        engine_factory("gqa"),
        out,
        prompts=32,
        validation=8,
        max_new_tokens=32,
        draft_vocab=128,
        horizon=4,
        epochs=6,
        batch_size=64,
        learning_rate=3e-3,
        dropout=0.0,
        # the greedy tokens alone: a random tiny model's next-token distributions are near uniform, so a distilled
        # head's loss cannot fall far below their entropy (~4.5 nats) and would show little of the fit
        distill=0.0,
    )
    facts = train_drafter(options, log=lambda line: None)
    return out, facts


RECOMMENDED_SAMPLING = {"top_k": 1, "repetition_penalty": 1.3, "max_new_tokens": 5}  # (top_k 1: deterministic)


@pytest.fixture(scope="session")
def recommending_engine(tmp_path_factory, checkpoint_factory):
    """The tiny gqa engine built from a checkpoint whose generation_config.json recommends RECOMMENDED_SAMPLING."""
    import json
    import shutil

    from builder.build import BuildOptions, build_engine

    source = tmp_path_factory.mktemp("recommending") / "ckpt"
    shutil.copytree(checkpoint_factory("gqa"), source)
    generation = json.loads((source / "generation_config.json").read_text())
    (source / "generation_config.json").write_text(json.dumps({**generation, **RECOMMENDED_SAMPLING}))
    out = source.parent / "engine"
    build_engine(BuildOptions(str(source), out, "fp32", 256, 4, 32), log=lambda line: None)
    return out
