"""The build stage: checkpoint -> model -> exported step graph -> validated engine artifact."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from builder import __version__, aoti, tensor_parallel, tensorrt
from builder.child_process import run_in_child_process
from builder.export import GRAPH_FILE, export_draft_graph, export_sampler_graph, export_step_graph
from builder.loaders import load_checkpoint
from builder.loaders.checkpoint import TokenizerSpec
from builder.loaders.default import DEFAULT_MODEL_NAME
from builder.phases import STEP_GRAPH, BuildShapes, default_prefill_chunk, plan_phases
from builder.quantization.gptq import GPTQOptions, calibration_tokens, gptq_model
from builder.quantization.kv_quant import KVCalibration, calibrate_kv_scales, calibration_windows
from builder.sampler_graph import TOP_LOGPROBS
from builder.speculation.draft_head import BeamSearchDrafter, load_draft_head
from builder.weights import (
    EMBEDDING,
    FLOAT_TYPES,
    auto_quantization,
    embedding_spec,
    holds_block_kind,
    kept_block_specs,
    linear_sources,
    load_model,
    split_linears,
    store_embedding,
    wider_specs,
)
from engines.format import (
    BACKENDS,
    COLLECTIVES,
    SCHEMA_VERSION,
    EmbeddingBlocks,
    GPTQFacts,
    GraphSpec,
    KVCacheQuantization,
    KVCacheSpec,
    Manifest,
    QuantizationSpec,
    QuantMethod,
    SamplerSpec,
    ShardSpec,
    SpeculationMethod,
    SpeculationSpec,
    TokenizerInfo,
    open_artifact,
    write_manifest,
)
from engines.model_config import ModelConfig
from engines.resources import children_peak_rss_mb, peak_rss_mb
from plugins import argmax, blockwise_matmul, decode_attention, int4_matmul, native_ops, norm
from plugins.attention import check_head_dim
from plugins.quant_linear import QuantizedEmbedding, QuantizedLinear, QuantSpec

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUANT_BITS = {"int8": 8, "int4": 4, "gptq": 4}
# The fastest MatMulNBits kernels at batch 1 with int8 compute (int8 groups of 32 take a slow path;
# docs/measurements.md)
DEFAULT_GROUP = {"int4": 32, "int8": 128, "gptq": 32}
TOKENIZER_FILE = "tokenizer.json"
DRAFT_GRAPH = "draft"
SAMPLER_GRAPH = "sampler"
SPECULATION_METHODS = ("none", "redrafter", "prompt-lookup", "draft-model")
KV_CACHE_DTYPES = ("auto", "int8")
DRAFT_ENGINE = "draft"  # a draft-model engine's draft model: a complete engine in this subdirectory
PROMPT_LOOKUP_MAX_NGRAM = 3
# A lookup draft needs its context's last 2 tokens to have occurred before: after a 1-token match, drafts are
# mostly rejected and every tree node costs verify time (docs/measurements.md)
PROMPT_LOOKUP_MIN_NGRAM = 2
# The ReDrafter draft graph's linears: groups of 32 with int8 compute (in fp32 the beam search reads the head's whole
# table at every draft step, several times slower), which our Int4MatMul / Int8MatMul kernels take where the engine
# runs on onnxruntime's CPU provider. int4 is the default: it drafts as well as int8 for the shipped head (1.92
# against 1.91 tokens per verify step) at a quarter less per draft call (docs/measurements.md).
DRAFT_QUANTS = {"int8": QuantSpec(8, 32, 4), "int4": QuantSpec(4, 32, 4)}
# The draft's weights when the build does not say: the ReDrafter head's linears (above), a draft model's engine.
DEFAULT_DRAFT_QUANT = {"redrafter": "int4", "draft-model": "int8"}
# The head distilled for the embedded default model by `builder train-drafter` (see docs/speculative-decoding.md).
SHIPPED_DRAFT_HEAD = Path(__file__).parent / "speculation" / "drafters" / "smollm2-135m-instruct.redrafter.safetensors"


# Drafts per beam when the build does not say. A chain (prompt lookup, a draft model) pays one draft call per token
# (a draft model) or nothing (lookup) and one verify node each, so it can go deeper than ReDrafter's beams; the draft
# model's best length grows with how often it agrees with the target, and 4 is the middle ground for an unknown pair
# (docs/measurements.md).
DEFAULT_DRAFT_LEN = {"redrafter": 2, "prompt-lookup": 4, "draft-model": 4}


@dataclass(frozen=True)
class BuildOptions:
    source: str
    out: Path
    dtype: str = "fp32"
    max_seq_len: int | None = None  # default: min(2048, the model's max_position_embeddings)
    max_batch: int = 8
    prefill_chunk: int | None = None  # the largest prompt chunk one call computes (default: default_prefill_chunk)
    overwrite: bool = False
    # "auto" (a GGUF's own quantization, none for a Hugging Face checkpoint: weights.auto_quantization) | "none" |
    # "int8" | "int4" (round-to-nearest, symmetric, per group) | "gptq" (int4)
    quant: str = "auto"
    group_size: int | None = None  # default: 32 for int4, 128 for int8 (the fastest MatMulNBits kernels here)
    quantize_lm_head: bool = True
    # the token embedding table in blocks too, unless it is the float LM head itself (weights.embedding_spec)
    quantize_embedding: bool = True
    int8_compute: bool = True  # quantized matmuls quantize activations to int8 (onnxruntime accuracy_level 4)
    keep_source_blocks: bool = True  # GGUF Q4_0/Q4_1/Q8_0 weights that map exactly are taken as they are
    gptq: GPTQOptions = field(default_factory=GPTQOptions)
    speculative: str = "none"  # one of SPECULATION_METHODS
    draft_head: Path | None = None  # default for `default`: the shipped head
    # 2 beams x 2 + a 4-token prompt-lookup beam measured fastest for the default model (wider trees accept more
    # per step but their verify costs more than it brings on a CPU: docs/measurements.md)
    beam_width: int = 2
    draft_len: int | None = None  # drafts per beam; default DEFAULT_DRAFT_LEN[speculative]
    # the draft's linears: "int4" or "int8" (fused, int8 compute) or "none"; default DEFAULT_DRAFT_QUANT[speculative]
    draft_quant: str | None = None
    draft_model: str | None = None  # draft-model: the checkpoint of a smaller model with the target's vocabulary
    verify_tokens: int | None = None  # the longest chunk a verify call scores (default: the speculative tree, else 8)
    prompt_lookup_len: int = 4  # redrafter: also draft this many tokens by prompt lookup, as one more beam
    # redrafter: the runner verifies only draft tokens whose beam prefix the head gives at least this probability
    # (each tree node costs verify time; the value measured best, docs/measurements.md)
    min_draft_prob: float = 0.1
    # one of KV_CACHE_DTYPES: "auto" = the model's dtype; "int8" (builder/quantization/kv_quant.py)
    kv_cache_dtype: str = "auto"
    kv_calibration: KVCalibration = field(default_factory=KVCalibration)
    # our kernels (plugins/native_ops.py) where this machine can compile them: DecodeAttention for decode steps'
    # attention, Int4MatMul / Int8MatMul for int4 / int8 weights with int8 activations
    native_decode_attention: bool = True
    native_quantized_matmul: bool = True
    backend: str = "onnxruntime"  # one of engines.format.BACKENDS
    device: str = "cpu"  # aoti: the device the package is compiled for ("cpu" or "cuda")
    tensor_parallel: int = 1  # ranks: one step graph per rank, each with its share of the weights

    def __post_init__(self) -> None:
        if self.draft_len is None:
            object.__setattr__(self, "draft_len", DEFAULT_DRAFT_LEN.get(self.speculative, 0))
        if self.draft_quant is None:
            object.__setattr__(self, "draft_quant", DEFAULT_DRAFT_QUANT.get(self.speculative, "int8"))

    def draft_head_path(self) -> Path | None:
        if self.speculative not in SPECULATION_METHODS:
            raise ValueError(
                f"unknown speculation {self.speculative!r}; choose one of {', '.join(SPECULATION_METHODS)}"
            )
        if self.speculative != "redrafter":
            return None
        if self.draft_head is not None:
            return Path(self.draft_head)
        if self.source == DEFAULT_MODEL_NAME:
            return SHIPPED_DRAFT_HEAD
        raise ValueError("--speculative redrafter needs --draft-head (train one with `builder train-drafter ENGINE`)")

    @property
    def tree_depth(self) -> int:
        """The most drafts one speculative step can accept: its deepest beam."""
        if self.speculative == "redrafter":
            return max(self.draft_len, self.prompt_lookup_len)
        return self.draft_len if self.speculative in ("prompt-lookup", "draft-model") else 0

    @property
    def tree_nodes(self) -> int:
        """The largest token tree a speculative step verifies: the root plus every beam's drafts."""
        if self.speculative == "redrafter":
            return 1 + self.beam_width * self.draft_len + self.prompt_lookup_len
        return 1 + self.draft_len

    def prompt_lookup(self) -> SpeculationSpec | None:
        if self.speculative != "prompt-lookup":
            return None
        return SpeculationSpec(
            SpeculationMethod.PROMPT_LOOKUP,
            draft_len=self.draft_len,
            max_tree_nodes=self.tree_nodes,
            max_ngram=PROMPT_LOOKUP_MAX_NGRAM,
            min_ngram=PROMPT_LOOKUP_MIN_NGRAM,
        )

    def quant_spec(self) -> QuantSpec | None:
        if self.quant == "none":
            return None
        if self.quant not in QUANT_BITS:
            raise ValueError(f"unknown quantization {self.quant!r}; choose one of auto, none, {', '.join(QUANT_BITS)}")
        group = self.group_size or DEFAULT_GROUP[self.quant]
        # int8 activations are onnxruntime's MatMulNBits option; the torch backends' kernel computes in float
        int8_compute = self.int8_compute and self.backend == "onnxruntime"
        return QuantSpec(QUANT_BITS[self.quant], group, 4 if int8_compute else 0)

    def quantization(self) -> QuantizationSpec:
        """The manifest's quantization section as the options ask for it (the build adds what it kept)."""
        spec = self.quant_spec()
        if spec is None:
            return QuantizationSpec()
        gptq = None
        if self.quant == "gptq":
            texts = " + ".join(Path(p).name for p in self.gptq.calibration)
            calibration = f"{texts}: {self.gptq.samples} x {self.gptq.sample_len} tokens"
            gptq = GPTQFacts(self.gptq.damping, self.gptq.act_order, static_groups=True, calibration=calibration)
        return QuantizationSpec(
            method=QuantMethod.GPTQ if gptq else QuantMethod.RTN,
            bits=spec.bits,
            group_size=spec.block_size,
            lm_head=self.quantize_lm_head,
            accuracy_level=spec.accuracy_level if self.backend == "onnxruntime" else None,
            op=self.quantized_op(),
            gptq=gptq,
        )

    def quantized_op(self) -> str:
        """What the quantized linears run, as the manifest records it."""
        if self.backend == "onnxruntime":
            # blocks with minimums (GGUF Q4_1, Q5_1, ...) cannot be MatMulNBits nodes; with our kernels they are ours
            return "com.microsoft::MatMulNBits, or Int4MatMul / Int8MatMul for blocks with minimums"
        if self.backend == "aoti" and self.device == "cpu":
            return "plugins::blockwise_matmul as dequantize + matmul (AOTInductor CPU: not a fused kernel)"
        return "plugins::blockwise_matmul (Triton kernel, block minimums fused)"


@dataclass
class BuildReport:
    out: Path
    seconds: float = 0.0
    peak_rss_mb: float = 0.0  # the largest of the build's processes (a tensor-parallel build's ranks have their own)
    files: dict[str, int] = field(default_factory=dict)
    phases: dict[str, str] = field(default_factory=dict)
    quantization: QuantizationSpec = field(default_factory=QuantizationSpec)
    speculation: SpeculationSpec | None = None

    @classmethod
    def of(cls, out: Path, manifest: Manifest, seconds: float) -> BuildReport:
        return cls(
            out=out,
            seconds=seconds,
            peak_rss_mb=max(peak_rss_mb(), children_peak_rss_mb()),
            files={str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()},
            phases={name: phase.describe() for name, phase in manifest.phases.items()},
            quantization=manifest.quantization,
            speculation=manifest.speculation,
        )

    def lines(self) -> list[str]:
        total = sum(self.files.values())
        out = [f"engine: {self.out}"]
        out += [f"  {name:<24} {size / 2**20:10.1f} MiB" for name, size in self.files.items()]
        out.append(f"  {'total':<24} {total / 2**20:10.1f} MiB")
        out += [f"  phase {name:<10} {shape}" for name, shape in self.phases.items()]
        out.append(f"  quantization {_key_values(self.quantization.facts())}")
        if self.speculation:
            out.append(f"  speculation {_key_values(self.speculation.facts())}")
        out.append(f"built in {self.seconds:.1f} s, peak RSS {self.peak_rss_mb:.0f} MiB")
        return out


def build_engine(options: BuildOptions, log: Callable[[str], None] = print) -> BuildReport:
    """The build's steps: read the checkpoint, plan the shapes, load (and quantize) the weights, trace and emit the
    graphs into a staging directory, write the manifest last and move the artifact into place."""
    _check_options(options)
    out = Path(options.out)
    _prepare_out(out, options.overwrite)
    draft_head_path = options.draft_head_path()
    progress = _Progress(5 if draft_head_path is not None or options.speculative == "draft-model" else 4, log)

    progress.step(1, f"reading checkpoint {options.source}")
    checkpoint = load_checkpoint(options.source)
    options = _resolve_auto_quantization(options, checkpoint, log)
    shapes = _plan_shapes(options, checkpoint.config, log)
    drafter, speculation = _prepare_speculation(options, checkpoint, draft_head_path)
    _log_checkpoint(checkpoint, log)

    _warn_if_speculation_is_inexact(options, log)
    kernels = _native_kernel_choice(options, log)
    with _staging(out) as staging:
        if options.tensor_parallel > 1:
            graphs, shards, quantization = _emit_rank_graphs(
                options, checkpoint, shapes, staging, kernels, progress, log
            )
            target = {}
        else:
            progress.step(2, f"loading weights as {_weights_description(options)}")
            model, quantization = _load_weights(
                options, checkpoint, _embedding_quant(options, checkpoint), shapes, kernels, log
            )
            graphs, target = _emit_step_graph(
                options, checkpoint.config, model, shapes, staging, kernels, progress, log
            )
            shards = []
            del model  # the float weights are in the graph's file now; the side graphs need far less
        graphs[SAMPLER_GRAPH] = export_sampler_graph(checkpoint.config.vocab_size, options.tree_depth, staging)
        if drafter is not None:
            progress.step(4, f"exporting the ReDrafter draft graph from {draft_head_path}")
            graphs[DRAFT_GRAPH] = _draft_graph(options, drafter, kernels, staging, log)
        if options.speculative == "draft-model":
            progress.step(4, f"building the draft model {options.draft_model} ({options.draft_quant})")
            draft_options = _draft_model_options(options, staging / DRAFT_ENGINE, shapes.max_seq_len)
            build_engine(draft_options, log=lambda line: log(f"      draft: {line}"))
        progress.step(progress.total, "writing tokenizer, manifest and checksums")
        manifest = _write_manifest(
            staging, options, checkpoint, shapes, graphs, quantization, speculation, target, shards
        )
    return BuildReport.of(out, manifest, progress.seconds())


def _emit_rank_graphs(
    options: BuildOptions,
    checkpoint,
    shapes: BuildShapes,
    staging: Path,
    kernels: dict[str, bool],
    progress: _Progress,
    log: Callable[[str], None],
) -> tuple[dict[str, GraphSpec], list[ShardSpec], QuantizationSpec]:
    """One step graph per rank (builder/tensor_parallel.py), each traced from a model that holds only that rank's
    share of the weights, streamed from the checkpoint once per rank; rank 0's is the manifest's step graph. Each
    rank is built in a process of its own (builder/child_process.py), so the build's peak memory is one rank's
    (where GPTQ or an int8 KV cache's calibration runs the whole model, as a single-rank build does, in one more)."""
    shards, quantization, whole = [], None, None
    if options.quant == "gptq" or options.kv_cache_dtype == "int8":  # what no rank alone can compute
        log("      GPTQ / the int8 KV cache's scales: run on the whole model, in a process of its own")
        whole = run_in_child_process(whole_model_facts, (options, shapes, kernels), log, "the whole model's run")
    for share in tensor_parallel.plan_shares(checkpoint.config, options.tensor_parallel):
        rank_share = None if whole is None else whole.share(checkpoint.config, share)
        job = (options, share, shapes, staging, kernels, progress.total, progress.start, rank_share)
        shard, quantization = run_in_child_process(emit_rank_graph, job, log, f"the build of rank {share.rank}")
        shards.append(shard)
    return {STEP_GRAPH: shards[0].graph}, shards, quantization


def emit_rank_graph(
    options: BuildOptions,
    share: tensor_parallel.Share,
    shapes: BuildShapes,
    staging: Path,
    kernels: dict[str, bool],
    total_steps: int,
    start: float,
    whole: WholeModelFacts | None,
    log: Callable[[str], None],
) -> tuple[ShardSpec, QuantizationSpec]:
    """One rank's step graph and its share's place in the manifest (run by a process of its own); `whole`: its
    share of what the whole model's run computed (GPTQ's weights, an int8 KV cache's scales)."""
    progress, rank, ranks = _Progress(total_steps, log, start), share.rank, options.tensor_parallel
    progress.step(2, f"rank {rank}/{ranks}: loading its share of the weights as {_weights_description(options)}")
    checkpoint = load_checkpoint(options.source)
    rank_source = _rank_checkpoint(checkpoint, share)
    # a rank's own config is untied (its head is a share), so the table's storage follows the whole checkpoint's
    embedding_quant = _embedding_quant(options, checkpoint)
    kv_scales = None
    if whole is not None and whole.kv_scales is not None:
        kv_scales = [(torch.from_numpy(k), torch.from_numpy(v)) for k, v in whole.kv_scales]
    gptq = whole is not None and whole.quantized is not None
    # GPTQ's weights replace the blocks of a model built as round-to-nearest in the same layout (whose log lines
    # would describe blocks replaced here)
    load_options, load_log = options, log
    if gptq:
        block = options.quant_spec().block_size
        load_options = replace(options, quant="int4", group_size=block, keep_source_blocks=False)
        load_log = lambda line: None  # noqa: E731
    model, quantization = _load_weights(
        load_options, rank_source, embedding_quant, shapes, kernels, load_log, share, kv_scales
    )
    if gptq:
        _load_quantized_share(model, whole.quantized)
        log(f"      rank {rank}: GPTQ's weights and embedding table, the whole model's cut to its share")
        embedding = quantization.embedding
        if embedding is not None and whole.table_from_head:  # GPTQ's blocks of the head, not a rounding of the table
            embedding = replace(embedding, rounded_from=None)
        quantization = replace(
            options.quantization(),
            embedding_from_head=quantization.embedding_from_head,
            embedding=embedding,
            kv_cache=quantization.kv_cache,
        )
    tensor_parallel.add_collectives(model, share, checkpoint.config.vocab_size)
    if kernels["QuantizedMatMul"]:
        _export_for_our_kernels(model)
    progress.step(3, f"rank {rank}/{ranks}: tracing its step graph with torch.export and emitting ONNX")
    file = GRAPH_FILE if rank == 0 else GRAPH_FILE.replace(".onnx", f".rank{rank}.onnx")
    step = _native_kernels(kernels, export_step_graph(model, staging, shapes.max_seq_len, file), staging, log)
    if step.native_library is None:
        step = replace(step, native_library=_kernel_library(staging).name)
    step = replace(step, native_ops=[*step.native_ops, "AllReduce", "AllGather"])
    log(f"      rank {rank}: built, peak RSS {peak_rss_mb():.0f} MiB")
    return ShardSpec(rank, step, *(list(bounds) for bounds in _share_bounds(share))), quantization


@dataclass(frozen=True)
class WholeModelFacts:
    """What a sharded build takes from a run of the whole model, which no rank alone can make: an int8 KV cache's
    (K, V) scales per layer, and GPTQ's weights (each quantized linear's name -> its blocks and scales). As numpy
    arrays, which pass between processes as plain bytes (torch tensors would go through shared memory)."""

    kv_scales: list[tuple[np.ndarray, np.ndarray]] | None
    quantized: dict[str, tuple[np.ndarray, np.ndarray]] | None
    table_from_head: bool = False  # the embedding table's blocks in `quantized` are the tied LM head's

    def share(self, config: ModelConfig, share: tensor_parallel.Share) -> WholeModelFacts:
        return WholeModelFacts(
            None if self.kv_scales is None else tensor_parallel.shard_kv_scales(self.kv_scales, share),
            None if self.quantized is None else tensor_parallel.shard_quantized(self.quantized, config, share),
            self.table_from_head,
        )


def whole_model_facts(
    options: BuildOptions, shapes: BuildShapes, kernels: dict[str, bool], log: Callable[[str], None]
) -> WholeModelFacts:
    """The whole model built as a single-rank build of `options` builds it, and what its ranks need of it (run by a
    process of its own)."""
    checkpoint = load_checkpoint(options.source)
    model, _ = _load_weights(options, checkpoint, _embedding_quant(options, checkpoint), shapes, kernels, log)
    kv_scales = None
    if options.kv_cache_dtype == "int8":
        kv_scales = [(layer.self_attn.k_scale.numpy(), layer.self_attn.v_scale.numpy()) for layer in model.model.layers]
    quantized = None
    if options.quant == "gptq":
        quantized = {
            name: (module.qweight.numpy(), module.scales.numpy())
            for name, module in model.named_modules()
            if isinstance(module, QuantizedLinear)
        }
        if model.embedding_from_head:  # the table is the tied head's blocks: a rank stores them as its own table
            quantized[EMBEDDING] = quantized["lm_head"]
    return WholeModelFacts(kv_scales, quantized, model.embedding_from_head)


def _load_quantized_share(model, quantized: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Every quantized linear of a rank's model (its embedding table too) takes its share of GPTQ's blocks."""
    for name, module in model.named_modules():
        if not isinstance(module, QuantizedLinear):
            continue
        if name not in quantized:
            raise ValueError(f"GPTQ's run of the whole model left no weights for {name}")
        qweight, scales = quantized[name]
        if qweight.shape[0] != module.qweight.shape[0] or qweight.size != module.qweight.numel():
            shape = tuple(module.qweight.shape)
            raise ValueError(f"GPTQ's {name} cut to this rank has blocks {qweight.shape}, the rank's {shape}")
        module.load_quantized_rows(0, torch.from_numpy(qweight), torch.from_numpy(scales))


def _share_bounds(share: tensor_parallel.Share) -> tuple[tuple[int, int], ...]:
    return share.kv_heads, share.heads, share.intermediate, share.vocab


def _rank_checkpoint(checkpoint, share: tensor_parallel.Share):
    """The checkpoint as one rank reads it: its config and its share of every tensor (a tied LM head is asked for
    by the embedding's name)."""
    config = checkpoint.config
    tied = config.tie_word_embeddings

    def read_tensors(keep=frozenset()):
        wanted = {"model.embed_tokens.weight" if tied and name == "lm_head.weight" else name for name in keep}
        return tensor_parallel.shard_tensors(checkpoint.read_tensors(frozenset(wanted)), config, share)

    return replace(
        checkpoint,
        config=tensor_parallel.rank_config(config, share),
        read_tensors=read_tensors,
        block_formats=tensor_parallel.shard_names(checkpoint.block_formats, config),
        weight_types=tensor_parallel.shard_names(checkpoint.weight_types, config),
    )


def _emit_step_graph(
    options: BuildOptions,
    config: ModelConfig,
    model,
    shapes: BuildShapes,
    staging: Path,
    kernels: dict[str, bool],
    progress: _Progress,
    log: Callable[[str], None],
) -> tuple[dict[str, GraphSpec], dict[str, str]]:
    """The step graph in the backend's form, and the target facts a compiled one must find again where it runs."""
    if options.backend == "aoti":
        progress.step(3, f"tracing the step graph, compiling it with AOTInductor for {options.device}; sampler as ONNX")
        step = aoti.export_aoti_step_graph(model, staging, shapes.max_seq_len, options.device)
        return {STEP_GRAPH: step}, aoti.target_facts(options.device)
    if options.backend == "tensorrt":
        progress.step(3, "tracing the step graph as ONNX for TensorRT and building its engine; sampler as ONNX")
        step = tensorrt.export_tensorrt_onnx(model, staging, shapes.max_seq_len)
        phases = list(plan_phases(shapes).values())
        engine = staging / tensorrt.ENGINE_FILE
        target = tensorrt.build_engine_file(staging / step.file, phases, config, shapes.max_seq_len, engine)
        return {STEP_GRAPH: replace(step, file=engine.name)}, target
    if kernels["QuantizedMatMul"]:
        _export_for_our_kernels(model)
    progress.step(3, "tracing the step and sampler graphs with torch.export and emitting ONNX")
    step = export_step_graph(model, staging, shapes.max_seq_len)
    return {STEP_GRAPH: _native_kernels(kernels, step, staging, log)}, {}


@dataclass
class _Progress:
    total: int
    log: Callable[[str], None]
    start: float = field(default_factory=time.perf_counter)

    def step(self, index: int, what: str) -> None:
        self.log(f"[{index}/{self.total}] {what} (t={self.seconds():.1f}s, rss={peak_rss_mb():.0f} MiB)")

    def seconds(self) -> float:
        return time.perf_counter() - self.start


def _check_options(options: BuildOptions) -> None:
    if options.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {options.dtype!r}; choose one of {', '.join(DTYPES)}")
    if options.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown KV cache dtype {options.kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if options.backend not in BACKENDS:
        raise ValueError(f"unknown backend {options.backend!r}; choose one of {', '.join(BACKENDS)}")
    if options.backend == "aoti" and (reason := aoti.unavailable_reason(options.device)):
        raise ValueError(reason)
    if options.backend == "tensorrt" and (reason := tensorrt.unavailable_reason()):
        raise ValueError(reason)
    if options.backend == "onnxruntime" and options.device != "cpu":
        raise ValueError("--device is the torch backends' choice: an onnxruntime engine runs where onnxruntime does")
    if options.tensor_parallel > 1:
        _check_tensor_parallel(options)
    quant = None if options.quant == "auto" else options.quant_spec()  # auto: checked again once resolved
    smallest = blockwise_matmul.MIN_INT4_BLOCK
    if options.backend != "onnxruntime" and quant is not None and quant.bits == 4 and quant.block_size < smallest:
        raise ValueError(
            f"the {options.backend} backend's int4 kernel takes groups of {smallest} or more, not {quant.block_size}"
        )


def _check_tensor_parallel(options: BuildOptions) -> None:
    """What a sharded build does not do yet, refused before any work."""
    if options.backend != "onnxruntime":
        raise ValueError(f"--tp builds onnxruntime engines only, not {options.backend}")
    if reason := native_ops.unavailable_reason():
        raise ValueError(f"--tp needs our kernel library for its collectives, which cannot be built here: {reason}")


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty (use --overwrite to replace it)")
        if not (out / "manifest.json").is_file():
            raise FileExistsError(f"refusing to overwrite {out}: it is not an engine artifact")


@contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A directory beside `out` the build writes into, renamed to `out` only when the build succeeded, so an
    interrupted build leaves no half artifact (and the engine it replaces stays until then)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield staging
        open_artifact(staging)  # what we wrote must pass the runner's own validation
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def _encoder(tokenizer: TokenizerSpec) -> Callable[[str], list[int]]:
    """Text -> token ids with the checkpoint's tokenizer (for calibration text)."""
    parsed = Tokenizer.from_str(tokenizer.tokenizer_json)
    return lambda text: parsed.encode(text).ids


def _plan_shapes(options: BuildOptions, config: ModelConfig, log: Callable[[str], None]) -> BuildShapes:
    check_head_dim(config.head_dim)
    window = config.sliding_window or config.max_position_embeddings
    max_seq_len = options.max_seq_len or min(2048, config.max_position_embeddings, window)
    if max_seq_len > window:  # beyond it the model would attend to fewer positions than the engine does
        raise ValueError(
            f"this model attends over a sliding window of {window} positions, which the engine does not "
            f"implement: build with --max-seq-len {window} or less (it equals full attention there)"
        )
    if max_seq_len > config.max_position_embeddings:
        log(f"warning: --max-seq-len {max_seq_len} exceeds the model's {config.max_position_embeddings} positions")
    return BuildShapes(
        max_seq_len=max_seq_len,
        max_batch=options.max_batch,
        prefill_chunk=options.prefill_chunk or default_prefill_chunk(options.kv_cache_dtype, max_seq_len),
        verify_tokens=options.verify_tokens or (options.tree_nodes if options.speculative != "none" else 8),
    )


def _prepare_speculation(
    options: BuildOptions, checkpoint, draft_head_path: Path | None
) -> tuple[BeamSearchDrafter | None, SpeculationSpec | None]:
    """The draft head (ReDrafter) and the manifest's speculation section, checked before the long export."""
    if draft_head_path is not None:
        return _load_drafter(draft_head_path, checkpoint.config, options)
    if options.speculative == "draft-model":
        return None, _check_draft_model(options, checkpoint)
    return None, options.prompt_lookup()


def _resolve_auto_quantization(options: BuildOptions, checkpoint, log: Callable[[str], None]) -> BuildOptions:
    """The options with `--quant auto` replaced by what it means for this checkpoint (groups of 32 unless asked
    otherwise, so that a GGUF's blocks can be kept)."""
    if options.quant != "auto":
        return options
    quant = auto_quantization(checkpoint.config, checkpoint.weight_types)
    types = sorted(set(checkpoint.weight_types.values())) or ["float"]
    log(f"      --quant auto: {quant} (the checkpoint's weights are {', '.join(types)})")
    resolved = replace(options, quant=quant, group_size=options.group_size or (32 if quant != "none" else None))
    _check_options(resolved)
    return resolved


def _log_checkpoint(checkpoint, log: Callable[[str], None]) -> None:
    config = checkpoint.config
    log(
        f"      {checkpoint.format} checkpoint: {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads} heads / {config.num_kv_heads} KV heads, vocab {config.vocab_size}"
    )
    if checkpoint.sampling_defaults:
        log(f"      recommended sampling (the runner's defaults): {_key_values(checkpoint.sampling_defaults)}")


def _warn_if_speculation_is_inexact(options: BuildOptions, log: Callable[[str], None]) -> None:
    """Our kernels compute a verify call's tokens bit for bit as decode steps would; where the step graph keeps
    onnxruntime's attention or quantized matmul and the target quantizes activations, their rounding differences grow
    into whole logits and greedy answers can part from the plain engine's."""
    quant = options.quant_spec()
    if quant is None or quant.accuracy_level != 4 or options.speculative == "none":
        return
    unbuildable, unrunnable = native_ops.unavailable_reason(), int4_matmul.unavailable_reason()
    reasons = [
        reason
        for reason, applies in (
            ("--onnxruntime-decode-attention keeps onnxruntime's attention", not options.native_decode_attention),
            ("--onnxruntime-quantized-matmul keeps onnxruntime's matmul", not options.native_quantized_matmul),
            (f"our kernels cannot be built here ({unbuildable})", unbuildable),
            (f"our matmul kernel cannot run here ({unrunnable})", unrunnable),
        )
        if applies
    ]
    if reasons:
        log(
            f"warning: this target quantizes activations to int8 and {'; '.join(reasons)}: a verify call's tokens then "
            "round differently from decode steps of them, int8 activations grow that into whole logits, and greedy "
            "answers can part from the plain engine's (docs/speculative-decoding.md)"
        )


def _weights_description(options: BuildOptions) -> str:
    """How the weights are loaded, for the progress line."""
    quant = options.quant_spec()
    if quant is None:
        return options.dtype
    head = "quantized" if options.quantize_lm_head else "float"
    activations = "int8" if quant.accuracy_level == 4 else "fp32"
    return (
        f"{options.quant} (group {quant.block_size}, LM head {head}, {activations} activations in the quantized "
        f"matmuls), rest {options.dtype}"
    )


def _embedding_quant(options: BuildOptions, checkpoint) -> QuantSpec | None:
    """The blocks the build stores the embedding table in (weights.embedding_spec), or None for float."""
    if not options.quantize_embedding:
        return None
    types = checkpoint.weight_types if options.keep_source_blocks and options.quant != "gptq" else {}
    tied = checkpoint.config.tie_word_embeddings
    return embedding_spec(options.quant_spec(), tied, options.quantize_lm_head, types)


def _load_weights(
    options: BuildOptions,
    checkpoint,
    embedding_quant: QuantSpec | None,
    shapes: BuildShapes,
    kernels: dict[str, bool],
    log: Callable[[str], None],
    share: tensor_parallel.Share | None = None,
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
):
    """The model with its weights as the options ask (GGUF blocks kept where they map exactly, the rest quantized
    from float, or GPTQ), the int8 KV cache's scales calibrated (or `kv_scales`, a rank's share of the whole
    model's), and the manifest's quantization section. `share`: a tensor-parallel rank's (its LM head holds its
    share of the vocabulary). `kernels`: which of our kernels the graphs run."""
    head_rows = None if share is None else tensor_parallel.head_rows(share)
    config, quant, quantization = checkpoint.config, options.quant_spec(), options.quantization()
    # the attention kernel wants rotary table rows for every position a call spans, padding tokens included
    rotary_positions = shapes.max_seq_len + max(shapes.prefill_chunk, shapes.verify_tokens)
    if options.quant == "gptq":
        # GPTQ needs each layer's float weights and inputs: the float model is held (not streamed) while it runs
        model = load_model(config, checkpoint.read_tensors(), DTYPES[options.dtype], max_positions=rotary_positions)
        tokens = calibration_tokens(
            _encoder(checkpoint.tokenizer), options.gptq.calibration, options.gptq.samples, options.gptq.sample_len
        )
        log(f"      GPTQ calibration: {quantization.gptq.calibration}")
        model = gptq_model(model, tokens, quant, options.quantize_lm_head, options.gptq, log)
        if embedding_quant is not None:
            store_embedding(model, embedding_quant)
    else:
        kept, wider, splits = {}, {}, {}
        if options.keep_source_blocks:
            splits = split_linears(
                config, quant, checkpoint.block_formats, checkpoint.weight_types, kernels["QuantizedMatMul"]
            )
            kept = kept_block_specs(
                config, quant, options.quantize_lm_head, checkpoint.block_formats, kernels["QuantizedMatMul"], splits
            )
            wider = wider_specs(config, quant, options.quantize_lm_head, checkpoint.weight_types, kept, splits)
        if splits:
            log(f"      {len(splits)} fused linears run as parts stored apart (their weights' GGUF types differ)")
        sources = linear_sources(config, options.quantize_lm_head, splits)
        keep = {name for module in kept for name in sources[module]}
        if _kept_embedding_blocks(embedding_quant, checkpoint):
            keep.add(f"{EMBEDDING}.weight")
        tensors = checkpoint.read_tensors(frozenset(keep))
        model = load_model(
            config,
            tensors,
            DTYPES[options.dtype],
            quant,
            options.quantize_lm_head,
            kept,
            rotary_positions,
            head_rows,
            embedding_quant,
            wider,
            splits,
        )
        if quant is not None:
            quantization = _kept_blocks(quantization, kept, wider, sources, checkpoint, log)
    if quant is not None:
        embedding = _embedding_facts(model, checkpoint, log)
        quantization = replace(quantization, embedding_from_head=model.embedding_from_head, embedding=embedding)
    if options.kv_cache_dtype == "int8":
        calibration = options.kv_calibration
        if kv_scales is None:
            windows = calibration_windows(_encoder(checkpoint.tokenizer), calibration, shapes.max_seq_len)
            kv_scales = calibrate_kv_scales(model, windows)
        model.use_int8_kv_cache(kv_scales)
        kv_cache = KVCacheQuantization("int8", "static, per layer, kv head and channel", calibration.describe())
        quantization = replace(quantization, kv_cache=kv_cache)
        log(f"      int8 KV cache, scales calibrated on {calibration.describe()}")
    return model, quantization


def _kept_embedding_blocks(embedding_quant: QuantSpec | None, checkpoint) -> str | None:
    """The GGUF type of the embedding's blocks where the table holds them as they are (weights.embedding_spec)."""
    kind = checkpoint.block_formats.get(f"{EMBEDDING}.weight")
    return kind if embedding_quant is not None and holds_block_kind(embedding_quant, kind) else None


def _embedding_facts(model, checkpoint, log: Callable[[str], None]) -> EmbeddingBlocks | None:
    """The manifest's record of an embedding table stored in blocks of its own, with a line for the log."""
    if model.embedding_from_head:
        log("      embedding table: read from the quantized LM head's blocks (no copy)")
        return None
    table = model.model.embed_tokens
    if not isinstance(table, QuantizedEmbedding):
        log("      embedding table: float")
        return None
    spec, kept = table.spec, _kept_embedding_blocks(table.spec, checkpoint)
    kind = checkpoint.weight_types.get(f"{EMBEDDING}.weight")
    facts = EmbeddingBlocks(
        bits=spec.bits,
        group_size=spec.block_size,
        minimums=spec.minimums,
        source_blocks=kept,
        rounded_from=None if kept or kind in (None, *FLOAT_TYPES) else kind,
        bytes=table.stored_bytes(),
    )
    origin = f"the file's {kept} blocks" if kept else f"rounded to nearest from {facts.rounded_from or 'float'}"
    log(f"      embedding table: int{spec.bits} blocks of {spec.block_size}, {origin}, {facts.bytes / 2**20:.1f} MiB")
    return facts


def _kept_blocks(
    quantization: QuantizationSpec, kept: dict, wider: dict, sources: dict[str, list[str]], checkpoint, log
) -> QuantizationSpec:
    """The quantization section with which linears kept their GGUF blocks and which were quantized from float
    (and, for a GGUF, from which of its types: a K-quant requantized is a loss the user should see; and how many
    went to int8 because the file gives them more bits than the build's)."""
    total = len(sources)
    methods = {0: QuantMethod.RTN, total: QuantMethod.GGUF_BLOCKS}
    kept_names = [name for module in kept for name in sources[module]]
    requantized = [name for module, names in sources.items() if module not in kept for name in names]
    quantization = replace(
        quantization,
        method=methods.get(len(kept), QuantMethod.GGUF_BLOCKS_RTN),
        source_blocks_kept=dict(sorted(Counter(checkpoint.block_formats[n] for n in kept_names).items())),
        linears_kept=len(kept),
        linears_requantized=total - len(kept),
        linears_widened=len(wider),
        requantized_from=dict(
            sorted(Counter(checkpoint.weight_types[n] for n in requantized if n in checkpoint.weight_types).items())
        ),
        block_offsets=any(spec.minimums for spec in kept.values()),
    )
    origin = "from float"
    if quantization.requantized_from:
        origin = f"again from the file's {_key_values(quantization.requantized_from)} weights"
    if wider:
        origin += f", {len(wider)} of them to int8 (the file gives them more than {quantization.bits} bits)"
    log(
        f"      quantized linears: {len(kept)} keep their GGUF blocks {quantization.source_blocks_kept or ''}, "
        f"{total - len(kept)} quantized {origin} ({quantization.method})"
    )
    return quantization


def _write_manifest(
    staging: Path,
    options: BuildOptions,
    checkpoint,
    shapes: BuildShapes,
    graphs: dict[str, GraphSpec],
    quantization: QuantizationSpec,
    speculation: SpeculationSpec | None,
    target: dict[str, str],
    shards: list[ShardSpec],
) -> Manifest:
    (staging / TOKENIZER_FILE).write_text(checkpoint.tokenizer.tokenizer_json)
    config, tokenizer = checkpoint.config, checkpoint.tokenizer
    kv_dtype = "int8" if options.kv_cache_dtype == "int8" else _numpy_dtype(options.dtype)
    manifest = Manifest(
        schema_version=SCHEMA_VERSION,
        builder_version=__version__,
        source=checkpoint.source,
        backend=options.backend,
        dtype=options.dtype,
        max_seq_len=shapes.max_seq_len,
        model=config,
        tokenizer=TokenizerInfo(
            TOKENIZER_FILE, tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token, tokenizer.add_bos_token
        ),
        graphs=graphs,
        phases=plan_phases(shapes),
        kv_cache=KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype),
        sampler=SamplerSpec(SAMPLER_GRAPH, options.tree_depth, TOP_LOGPROBS),
        quantization=quantization,
        speculation=speculation,
        sampling_defaults=checkpoint.sampling_defaults,
        device=options.device,
        target=target,
        tensor_parallel=options.tensor_parallel,
        shards=shards,
        collectives=COLLECTIVES if shards else {},
    )
    return write_manifest(staging, manifest)


def _native_kernel_choice(options: BuildOptions, log: Callable[[str], None]) -> dict[str, bool]:
    """Which of our kernels the engine's ONNX graphs will run (the options' wish where this machine can build and run
    them; none where another backend runs the step graph), saying why where one is left out."""
    wanted = {"DecodeAttention": options.native_decode_attention, "QuantizedMatMul": options.native_quantized_matmul}
    if options.backend != "onnxruntime" or not any(wanted.values()):
        return dict.fromkeys(wanted, False)
    reason = native_ops.unavailable_reason()
    if reason is not None:
        log(f"      kernels: onnxruntime's own ops ({reason})")
        return dict.fromkeys(wanted, False)
    if wanted["DecodeAttention"] and options.dtype != "fp32":
        log(
            "      decode attention: onnxruntime's GroupQueryAttention (ours computes in fp32 only, not "
            f"{options.dtype})"
        )
        wanted["DecodeAttention"] = False
    if wanted["QuantizedMatMul"] and (cpu := int4_matmul.unavailable_reason()):
        log(f"      quantized matmuls: onnxruntime's MatMulNBits ({cpu})")
        wanted["QuantizedMatMul"] = False
    return wanted


def _export_for_our_kernels(model) -> None:
    """Linears with block minimums (GGUF Q4_1, Q4_K; Q5_1, Q5_K) export as our Int4MatMul / Int8MatMul node (the
    graph stage makes the latter Int5MatMul), minimums inside it, where the kernels compute what they ask: int8
    activations (accuracy_level 4), blocks of 32, int4 values or int8 ones within 5 bits. The embedding lookup from a
    tied head's blocks exports as our QuantizedRows node where our kernels run the head: it then reads the head's
    blocks in the form the head's node takes them (column tiles, factored or 6-bit), no copy and no other form."""
    for linear in model.modules():
        if isinstance(linear, QuantizedLinear) and linear.minimums is not None:
            linear.native_minimums = int4_matmul.takes_minimums(linear.spec, linear.qweight.numpy())
    head = model.lm_head
    if model.embedding_from_head:
        head.native_rows = int4_matmul.covers(head.spec, head.in_features, head.qweight.numpy(), head.scales.numpy())


def _native_kernels(wanted: dict[str, bool], graph: GraphSpec, staging: Path, log: Callable[[str], None]) -> GraphSpec:
    """The graph with the nodes our kernels cover rewritten to them and their library beside it, or as it is
    (onnxruntime's own ops) where that cannot be had."""
    counts: dict[str, int] = {}
    if wanted["DecodeAttention"]:
        counts["DecodeAttention"] = decode_attention.use_in_graph(staging / graph.file)
    if wanted["QuantizedMatMul"]:
        counts.update(int4_matmul.use_in_graph(staging / graph.file))
    if any(counts.values()):  # the library ships with the graph: its ArgMax and norms take onnxruntime's too
        counts["ArgMax"] = argmax.use_in_graph(staging / graph.file)
        counts["SkipRmsNorm"] = norm.use_in_graph(staging / graph.file)
    used = [op for op, count in counts.items() if count]
    for op in used:
        log(f"      {op}: our kernel in {counts[op]} nodes of {graph.file}")
    if not used:
        return graph
    return replace(graph, native_library=_kernel_library(staging).name, native_ops=used)


def _draft_graph(
    options: BuildOptions,
    drafter: BeamSearchDrafter,
    kernels: dict[str, bool],
    staging: Path,
    log: Callable[[str], None],
) -> GraphSpec:
    """The ReDrafter draft graph, its quantized linears on our Int4MatMul / Int8MatMul where the step graph may use
    them and the engine runs on onnxruntime's CPU provider (a GPU engine's draft keeps MatMulNBits, which CUDA runs)."""
    draft = export_draft_graph(drafter, staging)
    if options.dtype != "fp32" or options.draft_quant not in DRAFT_QUANTS:
        return draft
    return _native_kernels(
        {"DecodeAttention": False, "QuantizedMatMul": kernels["QuantizedMatMul"]}, draft, staging, log
    )


def _kernel_library(staging: Path) -> Path:
    """Our kernel library in the artifact, compiled once per build (every rank's step graph uses the same one)."""
    library = staging / native_ops.LIBRARY_NAME
    return library if library.is_file() else native_ops.compile_library(staging)


def _numpy_dtype(dtype: str) -> str:
    return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[dtype]


def _check_draft_model(options: BuildOptions, target) -> SpeculationSpec:
    """Read the draft model's checkpoint before the long export: it must speak the target's tokenizer."""
    if options.draft_model is None:
        raise ValueError("--speculative draft-model needs --draft-model (a checkpoint of a model with this vocabulary)")
    if options.draft_quant not in ("none", "int8", "int4"):
        raise ValueError(f"unknown draft quantization {options.draft_quant!r}; choose none, int8 or int4")
    if options.draft_len < 1:
        raise ValueError("--draft-len must be at least 1")
    draft = load_checkpoint(options.draft_model)
    target_vocab = Tokenizer.from_str(target.tokenizer.tokenizer_json).get_vocab()
    draft_vocab = Tokenizer.from_str(draft.tokenizer.tokenizer_json).get_vocab()
    if draft.config.vocab_size != target.config.vocab_size or draft_vocab != target_vocab:
        raise ValueError(
            f"draft model {options.draft_model} does not share the target's tokenizer (vocabulary "
            f"{draft.config.vocab_size} vs {target.config.vocab_size} or different token ids)"
        )
    return SpeculationSpec(
        SpeculationMethod.DRAFT_MODEL,
        draft_len=options.draft_len,
        max_tree_nodes=options.tree_nodes,
        draft_quant=options.draft_quant,
        engine=DRAFT_ENGINE,
        source=draft.source,
    )


def _draft_model_options(options: BuildOptions, out: Path, max_seq_len: int) -> BuildOptions:
    """The draft model as an engine of its own: the target's shapes and backend, chunks of up to draft_len + 1
    tokens per verify call (a round feeds it the tokens it has not seen: the last one and the drafts just
    accepted)."""
    return BuildOptions(
        source=options.draft_model,
        out=out,
        dtype=options.dtype,
        max_seq_len=max_seq_len,
        max_batch=options.max_batch,
        prefill_chunk=options.prefill_chunk,
        quant=options.draft_quant,
        verify_tokens=options.draft_len + 1,
        keep_source_blocks=options.keep_source_blocks,
        backend=options.backend,
        device=options.device,
    )


def _load_drafter(path: Path, config, options: BuildOptions) -> tuple[BeamSearchDrafter, SpeculationSpec]:
    """Read and check the draft head before the long export, so a wrong head fails at once."""
    head, facts = load_draft_head(path)
    if (head.config.hidden_size, head.config.target_vocab_size) != (config.hidden_size, config.vocab_size):
        raise ValueError(
            f"draft head {path} was trained for hidden size {head.config.hidden_size} / vocab "
            f"{head.config.target_vocab_size}, "
            f"this model has {config.hidden_size} / {config.vocab_size}"
        )
    if options.prompt_lookup_len < 0:
        raise ValueError("--prompt-lookup-len must be 0 (off) or more")
    if not 0 <= options.min_draft_prob < 1:
        raise ValueError("--min-draft-prob must be in [0, 1)")
    if options.draft_quant not in ("none", *DRAFT_QUANTS):
        raise ValueError(f"unknown draft quantization {options.draft_quant!r}; choose none, int8 or int4")
    if options.draft_quant in DRAFT_QUANTS:
        head.quantize(DRAFT_QUANTS[options.draft_quant])
    drafter = BeamSearchDrafter(head, options.beam_width, options.draft_len)
    speculation = SpeculationSpec(
        SpeculationMethod.REDRAFTER,
        draft_len=options.draft_len,
        max_tree_nodes=options.tree_nodes,
        beam_width=options.beam_width,
        max_ngram=PROMPT_LOOKUP_MAX_NGRAM,
        min_ngram=PROMPT_LOOKUP_MIN_NGRAM,
        prompt_lookup_len=options.prompt_lookup_len,
        graph=DRAFT_GRAPH,
        draft_vocab_size=head.config.draft_vocab_size,
        draft_quant=options.draft_quant,
        min_draft_prob=options.min_draft_prob,
        head=facts,
    )
    return drafter, speculation


def _key_values(values: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in values.items())
