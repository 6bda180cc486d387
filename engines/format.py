"""The engine artifact on disk: a directory with manifest.json, phase graphs, weights stored once, tokenizer.

The manifest is the contract between the builder and every runner: it describes the model, the tokenizer, the
phases (which graph, which shape buckets), the KV cache layout, and a checksum per file. `open_artifact` validates
all of it before anything is handed to a backend, so a damaged or foreign directory fails with one clear message.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from engines.model_config import ModelConfig

# 9: GGUF Q4_K / Q5_0 blocks kept (Int4MatMul's minimums may be float32, as its scales then are), and the
# linears quantized to int8 because their GGUF type has more bits than the build's (`linears_widened`);
# 8: an untied embedding table stored in blocks of its own (`quantization.embedding`);
# 7: our quantized matmuls' weights, scales and minimums in column tiles (plugins/int4_matmul.c);
# 6: the backend's device and the target facts a compiled graph must find again (AOTInductor packages,
# TensorRT engines); 5: typed quantization and speculation sections (GPTQ's facts and the int8 KV cache's
# nested), every graph names the native ops it runs, and every engine has the score phase, the sampler's
# logit_bias input and drafts' scores;
# 4: the step graph also outputs the argmax of its logits (a plain greedy step's token, no sampler call);
# 3: a sampler graph chooses every token (sampling and speculative acceptance in the engine);
# 2: attention is one fused node per layer writing the cache in place (present_* bound to past_*), K stored
# [B, kv_heads, L, head_dim] like V, attention_bias replaces tree_mask; 1: new K/V were graph outputs.
SCHEMA_VERSION = 9
# onnxruntime: ONNX graphs with onnxruntime's and our own kernels; aoti: the step graph compiled by AOTInductor (its
# side graphs stay ONNX); tensorrt: a TensorRT engine built from the step graph's ONNX (builder/tensorrt.py)
BACKENDS = ("onnxruntime", "aoti", "tensorrt")
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
        return (
            f"graph {self.graph}, rows {_ladder(self.batch_sizes)}, tokens per row {_ladder(self.steps)}, "
            f"kv {_ladder(self.past_lengths)}, logits {self.logits}"
        )


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
    """The graph that chooses tokens: sampling and speculative acceptance (see builder/sampler_graph.py)."""

    graph: str  # key into Manifest.graphs
    max_depth: int  # the most drafts one step can accept (0 for an engine that does not speculate)
    top_logprobs: int  # the most alternatives it reports per token


class QuantMethod(str, Enum):
    """How the engine's linear weights were quantized."""

    NONE = "none"
    RTN = "rtn"  # round-to-nearest from float weights
    GPTQ = "gptq"
    GGUF_BLOCKS = "gguf-blocks"  # every linear keeps the GGUF file's own blocks
    GGUF_BLOCKS_RTN = "gguf-blocks+rtn"  # some keep them, the others are quantized from float

    def __str__(self) -> str:
        return self.value


class SpeculationMethod(str, Enum):
    REDRAFTER = "redrafter"  # a recurrent draft head with beam search, traced into the draft graph
    PROMPT_LOOKUP = "prompt-lookup"  # drafts copied from earlier in the context
    DRAFT_MODEL = "draft-model"  # a smaller engine of the same vocabulary, in a subdirectory

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class GPTQFacts:
    damping: float
    act_order: bool
    static_groups: bool
    calibration: str  # the calibration texts and how many windows of how many tokens


@dataclass(frozen=True)
class KVCacheQuantization:
    dtype: str  # "int8"
    scales: str
    calibration: str


@dataclass(frozen=True)
class EmbeddingBlocks:
    """A token embedding table the step graph stores in blocks of its own (not a tied head's), read a row a token."""

    bits: int
    group_size: int
    minimums: bool  # Q4_1-style per-block minimums
    source_blocks: str | None  # the GGUF type whose blocks it holds as they are; None: rounded to nearest here
    rounded_from: str | None  # the GGUF type it was rounded from (None: from float, or not rounded)
    bytes: int  # its blocks, scales and minimums in the graph's weights


@dataclass(frozen=True)
class QuantizationSpec:
    """What the build did to the weights (and the KV cache). Fields past `method` are None / empty for NONE."""

    method: QuantMethod = QuantMethod.NONE
    bits: int | None = None
    group_size: int | None = None
    lm_head: bool | None = None  # whether the LM head is quantized too
    accuracy_level: int | None = None  # 4: int8 activations in the quantized matmuls; 0: float
    op: str | None = None  # the graph op the quantized linears lower to
    gptq: GPTQFacts | None = None
    source_blocks_kept: dict[str, int] = field(default_factory=dict)  # GGUF block type -> linears keeping them
    linears_kept: int = 0
    linears_requantized: int = 0
    # of those, quantized to int8 instead of `bits`: their GGUF type has more bits (Q6_K where not kept, in an int4
    # build)
    linears_widened: int = 0
    requantized_from: dict[str, int] = field(default_factory=dict)  # GGUF type -> weights quantized again from float
    block_offsets: bool = False  # Q4_1-style per-block minimums (the blocks are scale * q + minimum)
    embedding_from_head: bool = False  # the tied quantized LM head's blocks are the embedding table (no float copy)
    embedding: EmbeddingBlocks | None = None  # the table's own blocks; None: float, or the head's (above)
    kv_cache: KVCacheQuantization | None = None

    def facts(self) -> dict[str, Any]:
        """Its method and the fields that differ from their defaults (for reports)."""
        defaults = QuantizationSpec()
        changed = {k: v for k, v in asdict(self).items() if v != getattr(defaults, k) and v is not None}
        return {"method": self.method, **changed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantizationSpec:
        gptq, kv_cache, embedding = data.get("gptq"), data.get("kv_cache"), data.get("embedding")
        return cls(
            **{
                **data,
                "method": QuantMethod(data["method"]),
                "gptq": None if gptq is None else GPTQFacts(**gptq),
                "embedding": None if embedding is None else EmbeddingBlocks(**embedding),
                "kv_cache": None if kv_cache is None else KVCacheQuantization(**kv_cache),
            }
        )


@dataclass(frozen=True)
class SpeculationSpec:
    """How a speculative engine drafts; the runner verifies trees of at most `max_tree_nodes` (root included)."""

    method: SpeculationMethod
    draft_len: int  # drafts per beam (chain)
    max_tree_nodes: int
    beam_width: int = 1
    # prompt lookup (and ReDrafter's extra lookup beam of prompt_lookup_len tokens): n-gram lengths tried
    max_ngram: int = 3
    min_ngram: int = 2
    prompt_lookup_len: int = 0
    graph: str | None = None  # redrafter: the draft graph (key into Manifest.graphs)
    draft_vocab_size: int | None = None  # redrafter: tokens the head can propose
    draft_quant: str | None = None  # the draft's linears: "int8", "int4" or "none"
    min_draft_prob: float = 0.0  # redrafter: draft tokens the head finds less likely than this are not verified
    head: dict[str, Any] | None = None  # redrafter: the head's training record, as the head file gives it
    engine: str | None = None  # draft-model: the draft engine's subdirectory
    source: str | None = None  # draft-model: the checkpoint it was built from

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculationSpec:
        return cls(**{**data, "method": SpeculationMethod(data["method"])})

    def facts(self) -> dict[str, Any]:
        """Its fields that are set, the head's training record aside (for reports)."""
        return {k: v for k, v in asdict(self).items() if v is not None and k != "head"}

    def head_tokens_per_verify(self) -> float | None:
        """A ReDrafter head's tokens per verify step on its validation prompts, for these beams and draft length, as its
        training record gives them (the head's own beams; prompt lookup adds to that at run time); None where the
        record has none (other methods, heads trained before it was kept)."""
        record = (self.head or {}).get("validation_tokens_per_step", {})
        return record.get(tree_shape_key(self.beam_width, self.draft_len))


def tree_shape_key(beams: int, draft_len: int) -> str:
    """How a draft head's training record names a tree of `beams` beams of `draft_len` drafts."""
    return f"beams{beams}_len{draft_len}"


@dataclass(frozen=True)
class ShardSpec:
    """One tensor-parallel rank's part of the engine (builder/tensor_parallel.py): its step graph, and [first, end)
    of the KV heads, query heads, MLP inner width and vocabulary its weights cover. Its KV cache holds its KV heads
    only."""

    rank: int
    graph: GraphSpec
    kv_heads: list[int]
    heads: list[int]
    intermediate: list[int]
    vocab: list[int]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardSpec:
        return cls(**{**data, "graph": _graph_spec(data["graph"])})


# How a tensor-parallel engine's ranks meet, as the manifest records it.
COLLECTIVES = {
    "all_reduce": "AllReduce (fp32 sum, in rank order) after every o_proj and down_proj",
    "all_gather": "AllGather of the vocabulary-parallel LM head's logits",
    "transport": "shared memory between the rank processes of one host (plugins/collectives.c)",
}


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
    backend: str  # one of BACKENDS
    dtype: str
    max_seq_len: int
    model: ModelConfig
    tokenizer: TokenizerInfo
    graphs: dict[str, GraphSpec]
    phases: dict[str, PhaseSpec]
    kv_cache: KVCacheSpec
    sampler: SamplerSpec
    quantization: QuantizationSpec = field(default_factory=QuantizationSpec)
    speculation: SpeculationSpec | None = None
    tensor_parallel: int = 1
    shards: list[ShardSpec] = field(default_factory=list)  # one per rank where tensor_parallel > 1
    collectives: dict[str, str] = field(default_factory=dict)
    files: dict[str, FileEntry] = field(default_factory=dict)
    # SamplingParams defaults the model's makers recommend (generation_config.json / GGUF general.sampling.*): the
    # runner's defaults for what a request leaves unset, unless it is told to use vLLM's own (--generation-config vllm)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"  # where the step graph runs: "cpu" or "cuda" (an onnxruntime engine runs on either)
    # what a compiled step graph was built for and must find again where it runs ({"torch": "2.13.0", "gpu": "sm_90"})
    target: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def for_rank(self, rank: int) -> Manifest:
        """The manifest as one rank runs it: its step graph and its KV heads' cache (the same manifest for a
        single-rank engine)."""
        if self.tensor_parallel == 1:
            return self
        shard = self.shards[rank]
        step = self.phases["decode"].graph
        kv_cache = replace(self.kv_cache, num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0])
        return replace(self, graphs={**self.graphs, step: shard.graph}, kv_cache=kv_cache)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        graphs = {key: _graph_spec(g) for key, g in data["graphs"].items()}
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
            quantization=QuantizationSpec.from_dict(data["quantization"]),
            speculation=None if data["speculation"] is None else SpeculationSpec.from_dict(data["speculation"]),
            tensor_parallel=data["tensor_parallel"],
            shards=[ShardSpec.from_dict(shard) for shard in data.get("shards", [])],
            collectives=data.get("collectives", {}),
            files={name: FileEntry(**entry) for name, entry in data["files"].items()},
            sampling_defaults=data["sampling_defaults"],
            device=data["device"],
            target=data["target"],
        )


def _graph_spec(data: dict[str, Any]) -> GraphSpec:
    return GraphSpec(
        file=data["file"],
        inputs=[TensorSpec(**t) for t in data["inputs"]],
        outputs=[TensorSpec(**t) for t in data["outputs"]],
        native_library=data["native_library"],
        native_ops=data["native_ops"],
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
    if manifest.tensor_parallel != max(len(manifest.shards), 1):
        raise ArtifactError(
            f"{manifest_path} is malformed: {manifest.tensor_parallel} ranks but {len(manifest.shards)} shards"
        )
    graphs = list(manifest.graphs.values()) + [shard.graph for shard in manifest.shards]
    referenced = [g.file for g in graphs] + [manifest.tokenizer.file]
    referenced += [g.native_library for g in graphs if g.native_library]
    for name in referenced:
        if name not in manifest.files:
            raise ArtifactError(f"{manifest_path} references {name}, which has no checksum entry")
    return Artifact(directory, manifest)
