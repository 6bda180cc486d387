"""The engine artifact on disk: a directory with manifest.json, phase graphs, weights stored once, tokenizer.

The manifest is the contract between the builder and every runner: it describes the model, the tokenizer, the
phases (which graph, which shape buckets), the KV cache layout, and a checksum per file. `open_artifact` validates
all of it before anything is handed to a backend, so a damaged or foreign directory fails with one clear message.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engines.model_config import ModelConfig

# 4: the step graph also outputs the argmax of its logits (a plain greedy step's token, no sampler call);
# 3: a sampler graph chooses every token (sampling and speculative acceptance in the engine);
# 2: attention is one fused node per layer writing the cache in place (present_* bound to past_*), K stored
# [B, kv_heads, L, head_dim] like V, attention_bias replaces tree_mask; 1: new K/V were graph outputs.
SCHEMA_VERSION = 4
MANIFEST_NAME = "manifest.json"
_HASH_CHUNK = 1 << 24


class ArtifactError(ValueError):
    """The directory is not a usable engine artifact."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "float32", "int64", "bool", ...
    shape: list[int | str]  # str = a dimension that varies between buckets (named)


@dataclass(frozen=True)
class GraphSpec:
    file: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    # a file of the artifact: the onnxruntime custom-op library this graph's own ops need (plugins/native_ops.py)
    native_library: str | None = None
    native_ops: list[str] = field(default_factory=list)  # which of its ops the graph runs ("DecodeAttention", ...)


@dataclass(frozen=True)
class PhaseSpec:
    """One fixed-shape phase: the runner pads every call to one of these bucket combinations."""

    name: str  # "prefill" | "decode" | "verify"
    graph: str  # key into Manifest.graphs
    batch_sizes: list[int]
    steps: list[int]  # new tokens per row (T)
    past_lengths: list[int]  # KV-length buckets (L)
    logits: str  # "last": one position per row; "all": every new token

    def describe(self) -> str:
        """Its buckets in one line (a ladder can hold a thousand sizes)."""
        return (f"graph {self.graph}, rows {_ladder(self.batch_sizes)}, tokens per row {_ladder(self.steps)}, "
                f"kv {_ladder(self.past_lengths)}, logits {self.logits}")


def _ladder(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]} ({len(values)} buckets)"


@dataclass(frozen=True)
class KVCacheSpec:
    """The runner owns one buffer per layer for K and one for V and feeds them as `past_key.i` / `past_value.i`;
    the graph writes each row's new tokens at positions past_lens[b] + t and returns the buffers as
    `present_key.i` / `present_value.i`, which the runner must bind to the same memory (update "in_place")."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    key_layout: str = "batch,kv_heads,position,head_dim"
    value_layout: str = "batch,kv_heads,position,head_dim"
    update: str = "in_place"


@dataclass(frozen=True)
class SamplerSpec:
    """The graph that chooses tokens: sampling and speculative acceptance (see builder/sampler.py)."""

    graph: str  # key into Manifest.graphs
    max_depth: int  # the most drafts one step can accept (0 for an engine that does not speculate)
    top_logprobs: int  # the most alternatives it reports per token


@dataclass(frozen=True)
class TokenizerInfo:
    file: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    builder_version: str
    source: str
    backend: str  # "onnxruntime"
    dtype: str
    max_seq_len: int
    model: ModelConfig
    tokenizer: TokenizerInfo
    graphs: dict[str, GraphSpec]
    phases: dict[str, PhaseSpec]
    kv_cache: KVCacheSpec
    sampler: SamplerSpec
    quantization: dict[str, Any] = field(default_factory=lambda: {"method": "none"})
    speculation: dict[str, Any] | None = None
    tensor_parallel: int = 1
    files: dict[str, FileEntry] = field(default_factory=dict)
    # SamplingParams defaults the model's makers recommend (generation_config.json / GGUF general.sampling.*): the
    # runner's defaults for what a request leaves unset, unless it is told to use vLLM's own (--generation-config vllm)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        graphs = {
            key: GraphSpec(
                file=g["file"],
                inputs=[TensorSpec(**t) for t in g["inputs"]],
                outputs=[TensorSpec(**t) for t in g["outputs"]],
                native_library=g.get("native_library"),
                native_ops=native_ops_of(g),
            )
            for key, g in data["graphs"].items()
        }
        return cls(
            schema_version=data["schema_version"],
            builder_version=data["builder_version"],
            source=data["source"],
            backend=data["backend"],
            dtype=data["dtype"],
            max_seq_len=data["max_seq_len"],
            model=ModelConfig.from_dict(data["model"]),
            tokenizer=TokenizerInfo(**data["tokenizer"]),
            graphs=graphs,
            phases={key: PhaseSpec(**p) for key, p in data["phases"].items()},
            kv_cache=KVCacheSpec(**data["kv_cache"]),
            sampler=SamplerSpec(**data["sampler"]),
            quantization=data.get("quantization", {"method": "none"}),
            speculation=data.get("speculation"),
            tensor_parallel=data.get("tensor_parallel", 1),
            files={name: FileEntry(**entry) for name, entry in data.get("files", {}).items()},
            sampling_defaults=data.get("sampling_defaults", {}),
        )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, manifest: Manifest) -> Manifest:
    """Checksum every file the artifact holds and write manifest.json last, so a half-written build has none."""
    files = {
        path.name: FileEntry(size=path.stat().st_size, sha256=file_sha256(path))
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != MANIFEST_NAME
    }
    manifest = Manifest(**{**manifest.__dict__, "files": files})
    (directory / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


@dataclass(frozen=True)
class Artifact:
    directory: Path
    manifest: Manifest

    def path(self, name: str) -> Path:
        return self.directory / name


def open_artifact(directory: str | Path, verify_checksums: bool = True) -> Artifact:
    """Open and validate an engine artifact; every failure is an ArtifactError with one clear message."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"engine not found: {directory} is not a directory")
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ArtifactError(f"{directory} is not an engine artifact (no {MANIFEST_NAME})")
    try:
        data = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{manifest_path} is corrupt: {err}") from None
    if not isinstance(data, dict) or "schema_version" not in data:
        raise ArtifactError(f"{manifest_path} is not an engine manifest (no schema_version)")
    if data["schema_version"] != SCHEMA_VERSION:
        raise ArtifactError(
            f"engine schema version {data['schema_version']!r} is not supported by this runner "
            f"(supported: {SCHEMA_VERSION}); rebuild the engine with this version of the builder"
        )
    try:
        manifest = Manifest.from_dict(data)
    except (KeyError, TypeError, ValueError) as err:
        raise ArtifactError(f"{manifest_path} is malformed: {err!r}") from None
    for name, entry in manifest.files.items():
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"engine file missing: {path}")
        size = path.stat().st_size
        if size != entry.size:
            raise ArtifactError(f"engine file {path} is truncated or altered: {size} bytes, expected {entry.size}")
        if verify_checksums and file_sha256(path) != entry.sha256:
            raise ArtifactError(f"engine file {path} is corrupt: checksum mismatch")
    referenced = [g.file for g in manifest.graphs.values()] + [manifest.tokenizer.file]
    referenced += [g.native_library for g in manifest.graphs.values() if g.native_library]
    for name in referenced:
        if name not in manifest.files:
            raise ArtifactError(f"{manifest_path} references {name}, which has no checksum entry")
    return Artifact(directory, manifest)


def native_ops_of(graph: dict[str, Any]) -> list[str]:
    """Our ops a manifest's graph entry runs: engines built before Int4MatMul name only the library, which then held
    DecodeAttention alone."""
    return graph.get("native_ops", ["DecodeAttention"] if graph.get("native_library") else [])
