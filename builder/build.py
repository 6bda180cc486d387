"""The build stage: checkpoint -> model -> exported step graph -> validated engine artifact."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from builder import __version__
from builder.draft_head import BeamSearchDrafter, load_draft_head
from builder.export import export_draft_graph, export_sampler_graph, export_step_graph
from builder.gptq import GPTQOptions, calibration_tokens, gptq_model
from builder.kv_quant import KVCalibration, calibrate_kv_scales, calibration_windows
from builder.loaders import load_checkpoint
from builder.loaders.checkpoint import TokenizerSpec
from builder.sampler import TOP_LOGPROBS
from builder.loaders.default import DEFAULT_MODEL_NAME
from builder.phases import STEP_GRAPH, BuildShapes, default_prefill_chunk, plan_phases
from builder.weights import kept_block_specs, linear_sources, load_model
from plugins import decode_attention, int4_matmul, native_ops
from plugins.attention import check_head_dim
from plugins.quant_linear import QuantSpec
from engines.resources import peak_rss_mb
from engines.format import (
    SCHEMA_VERSION, GraphSpec, KVCacheSpec, Manifest, SamplerSpec, TokenizerInfo, open_artifact, write_manifest,
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUANT_BITS = {"int8": 8, "int4": 4, "gptq": 4}
# Measured for a 576x1536 MatMulNBits at batch 1 with int8 compute on the 2-core AVX2 CI machine: int4 group 32:
# 37 us, group 128: 70 us; int8 group 32: 290 us (a slow path), group 128: 52 us.
DEFAULT_GROUP = {"int4": 32, "int8": 128, "gptq": 32}
TOKENIZER_FILE = "tokenizer.json"
DRAFT_GRAPH = "draft"
SAMPLER_GRAPH = "sampler"
SPECULATION_METHODS = ("none", "redrafter", "prompt-lookup", "draft-model")
KV_CACHE_DTYPES = ("auto", "int8")
DRAFT_ENGINE = "draft"  # a draft-model engine's draft model: a complete engine in this subdirectory
PROMPT_LOOKUP_MAX_NGRAM = 3
# A lookup draft needs its context's last 2 tokens to have occurred before: after a 1-token match, drafts are
# mostly rejected and every tree node costs verify time (on the chat prompts, fp32, 2 threads: pure prompt lookup
# 1.00x -> 1.11x, ReDrafter's lookup beam 1.14x -> 1.21x; README, speculative decoding)
PROMPT_LOOKUP_MIN_NGRAM = 2
# The draft graph's linears: int8 groups of 128 with int8 compute (0.7 ms per 3x4 beam search for the default
# model's head on the CI CPU, against ~3.5 ms in fp32, which reads its 9.4 MB table at every draft step).
DRAFT_QUANT = QuantSpec(8, 128, 4)
# The head distilled for the embedded default model by `builder train-drafter` (see README, speculative decoding).
SHIPPED_DRAFT_HEAD = Path(__file__).parent / "drafters" / "smollm2-135m-instruct.redrafter.safetensors"


# Drafts per beam when the build does not say. A chain (prompt lookup, a draft model) pays one draft call per token
# (a draft model) or nothing (lookup) and one verify node each, so it can go deeper than ReDrafter's beams; the draft
# model's best length grows with how often it agrees with the target (the default model's int4 draft of its fp32 engine,
# ~97% per token: 6 decoded 7% faster than 4 in the same rounds, see README), 4 is the middle ground for an unknown pair.
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
    quant: str = "none"  # "none" | "int8" | "int4" (round-to-nearest, symmetric, per group) | "gptq" (int4)
    group_size: int | None = None  # default: 32 for int4, 128 for int8 (the fastest MatMulNBits kernels here)
    quantize_lm_head: bool = True
    int8_compute: bool = True  # quantized matmuls quantize activations to int8 (onnxruntime accuracy_level 4)
    keep_source_blocks: bool = True  # GGUF Q4_0/Q4_1/Q8_0 weights that map exactly are taken as they are
    gptq: GPTQOptions = field(default_factory=GPTQOptions)
    speculative: str = "none"  # one of SPECULATION_METHODS
    draft_head: Path | None = None  # default for `default`: the shipped head
    # 2 beams x 2 + a 4-token prompt-lookup beam measured fastest for the default model on the CI CPU (1.33x on
    # chat, 1.67x on a summary; 3 x 4 accepts more per step but its 13-node verify costs 1.6 decode steps there)
    beam_width: int = 2
    draft_len: int | None = None  # drafts per beam; default DEFAULT_DRAFT_LEN[speculative]
    # the draft's linears: "int8" (fused MatMulNBits, int8 compute) or "none"; a draft model may also be "int4"
    draft_quant: str = "int8"
    draft_model: str | None = None  # draft-model: the checkpoint of a smaller model with the target's vocabulary
    verify_tokens: int | None = None  # the longest chunk a verify call scores (default: the speculative tree, else 8)
    prompt_lookup_len: int = 4  # redrafter: also draft this many tokens by prompt lookup, as one more beam
    # redrafter: the runner verifies only draft tokens whose beam prefix the head gives at least this probability
    # (each tree node costs ~0.1 decode step here); 0.1 measured best of 0, 0.05, 0.1, 0.15, 0.2, 0.3
    min_draft_prob: float = 0.1
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES: "auto" = the model's dtype; "int8" (builder/kv_quant.py)
    kv_calibration: KVCalibration = field(default_factory=KVCalibration)
    # our kernels (plugins/native_ops.py) where this machine can compile them: DecodeAttention for decode steps'
    # attention, Int4MatMul for int4 weights with int8 activations
    native_decode_attention: bool = True
    native_int4_matmul: bool = True

    def __post_init__(self) -> None:
        if self.draft_len is None:
            object.__setattr__(self, "draft_len", DEFAULT_DRAFT_LEN.get(self.speculative, 0))

    def draft_head_path(self) -> Path | None:
        if self.speculative not in SPECULATION_METHODS:
            raise ValueError(f"unknown speculation {self.speculative!r}; choose one of {', '.join(SPECULATION_METHODS)}")
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

    def prompt_lookup(self) -> dict | None:
        if self.speculative != "prompt-lookup":
            return None
        return {"method": "prompt-lookup", "beam_width": 1, "draft_len": self.draft_len,
                "max_ngram": PROMPT_LOOKUP_MAX_NGRAM, "min_ngram": PROMPT_LOOKUP_MIN_NGRAM, "max_tree_nodes": self.tree_nodes}

    def quant_spec(self) -> QuantSpec | None:
        if self.quant == "none":
            return None
        if self.quant not in QUANT_BITS:
            raise ValueError(f"unknown quantization {self.quant!r}; choose one of none, {', '.join(QUANT_BITS)}")
        group = self.group_size or DEFAULT_GROUP[self.quant]
        return QuantSpec(QUANT_BITS[self.quant], group, 4 if self.int8_compute else 0)

    def quantization(self) -> dict:
        spec = self.quant_spec()
        if spec is None:
            return {"method": "none"}
        gptq = {} if self.quant != "gptq" else {
            "damping": self.gptq.damping, "act_order": self.gptq.act_order, "static_groups": True,
            "calibration": f"{' + '.join(Path(p).name for p in self.gptq.calibration)}: "
                           f"{self.gptq.samples} x {self.gptq.sample_len} tokens",
        }
        return {
            "method": "gptq" if gptq else "rtn", **gptq, "bits": spec.bits, "group_size": spec.block_size,
            "lm_head": self.quantize_lm_head, "accuracy_level": spec.accuracy_level, "op": "com.microsoft::MatMulNBits",
        }


@dataclass
class BuildReport:
    out: Path
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    files: dict[str, int] = field(default_factory=dict)
    phases: dict[str, str] = field(default_factory=dict)
    quantization: dict = field(default_factory=dict)
    speculation: dict | None = None

    def lines(self) -> list[str]:
        total = sum(self.files.values())
        out = [f"engine: {self.out}"]
        out += [f"  {name:<24} {size / 2**20:10.1f} MiB" for name, size in self.files.items()]
        out.append(f"  {'total':<24} {total / 2**20:10.1f} MiB")
        out += [f"  phase {name:<10} {shape}" for name, shape in self.phases.items()]
        out.append(f"  quantization {self.quantization}")
        if self.speculation:
            facts = {k: v for k, v in self.speculation.items() if k != "head"}
            out.append(f"  speculation {facts}")
        out.append(f"built in {self.seconds:.1f} s, peak RSS {self.peak_rss_mb:.0f} MiB")
        return out


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty (use --overwrite to replace it)")
        if not (out / "manifest.json").is_file():
            raise FileExistsError(f"refusing to overwrite {out}: it is not an engine artifact")


def _encoder(tokenizer: TokenizerSpec) -> Callable[[str], list[int]]:
    """Text -> token ids with the checkpoint's tokenizer (for calibration text)."""
    parsed = Tokenizer.from_str(tokenizer.tokenizer_json)
    return lambda text: parsed.encode(text).ids


def build_engine(options: BuildOptions, log: Callable[[str], None] = print) -> BuildReport:
    if options.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {options.dtype!r}; choose one of {', '.join(DTYPES)}")
    if options.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {options.kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    out = Path(options.out)
    _prepare_out(out, options.overwrite)
    draft_head_path = options.draft_head_path()
    total_steps = 5 if draft_head_path is not None or options.speculative == "draft-model" else 4
    start = time.perf_counter()

    def step(index: int, what: str) -> None:
        log(f"[{index}/{total_steps}] {what} (t={time.perf_counter() - start:.1f}s, rss={peak_rss_mb():.0f} MiB)")

    step(1, f"reading checkpoint {options.source}")
    checkpoint = load_checkpoint(options.source)
    config = checkpoint.config
    check_head_dim(config.head_dim)
    window = config.sliding_window or config.max_position_embeddings
    max_seq_len = options.max_seq_len or min(2048, config.max_position_embeddings, window)
    if max_seq_len > window:  # beyond it the model would attend to fewer positions than the engine does
        raise ValueError(f"this model attends over a sliding window of {window} positions, which the engine does not "
                         f"implement: build with --max-seq-len {window} or less (it equals full attention there)")
    if max_seq_len > config.max_position_embeddings:
        log(f"warning: --max-seq-len {max_seq_len} exceeds the model's {config.max_position_embeddings} positions")
    shapes = BuildShapes(
        max_seq_len=max_seq_len, max_batch=options.max_batch,
        prefill_chunk=options.prefill_chunk or default_prefill_chunk(options.kv_cache_dtype, max_seq_len),
        verify_tokens=options.verify_tokens or (options.tree_nodes if options.speculative != "none" else 8),
    )
    # the attention kernel wants rotary table rows for every position a call spans, padding tokens included
    rotary_positions = max_seq_len + max(shapes.prefill_chunk, shapes.verify_tokens)
    drafter, speculation = _load_drafter(draft_head_path, config, options) if draft_head_path else (None, options.prompt_lookup())
    if options.speculative == "draft-model":
        speculation = _check_draft_model(options, checkpoint)
    log(
        f"      {checkpoint.format} checkpoint: {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads} heads / {config.num_kv_heads} KV heads, vocab {config.vocab_size}"
    )
    if checkpoint.sampling_defaults:
        log(f"      recommended sampling (the runner's defaults): {_key_values(checkpoint.sampling_defaults)}")

    quant = options.quant_spec()
    gptq = options.quant == "gptq"
    kept = {} if gptq or not options.keep_source_blocks else kept_block_specs(
        config, quant, options.quantize_lm_head, checkpoint.block_formats
    )
    sources = linear_sources(config, options.quantize_lm_head)
    keep = frozenset(name for module in kept for name in sources[module])
    what = options.dtype if quant is None else (
        f"{options.quant} (group {quant.block_size}, LM head {'quantized' if options.quantize_lm_head else 'float'}, "
        f"{'int8' if quant.accuracy_level == 4 else 'fp32'} activations in the quantized matmuls), rest {options.dtype}"
    )
    if quant is not None and quant.accuracy_level == 4 and options.speculative != "none":
        log("warning: this target quantizes activations to int8, so speculation is exact only up to rounding: a verify "
            "call's attention over several tokens rounds differently from a one-token decode step, int8 activations "
            "grow that into whole logits, and greedy answers can part from the plain engine's (README: speculative decoding)")
    step(2, f"loading weights as {what}")
    quantization = options.quantization()
    if gptq:
        # GPTQ needs each layer's float weights and inputs: the float model is held (not streamed) while it runs
        model = load_model(config, checkpoint.read_tensors(), DTYPES[options.dtype], max_positions=rotary_positions)
        tokens = calibration_tokens(_encoder(checkpoint.tokenizer), options.gptq.calibration, options.gptq.samples,
                                    options.gptq.sample_len)
        log(f"      GPTQ calibration: {quantization['calibration']}")
        model = gptq_model(model, tokens, quant, options.quantize_lm_head, options.gptq, log)
    else:
        model = load_model(
            config, checkpoint.read_tensors(keep), DTYPES[options.dtype], quant, options.quantize_lm_head, kept,
            rotary_positions,
        )
    if quant is not None and not gptq:
        total = len(sources)
        quantization.update(
            method={0: "rtn", total: "gguf-blocks"}.get(len(kept), "gguf-blocks+rtn"),
            source_blocks_kept=dict(sorted(Counter(checkpoint.block_formats[n] for n in keep).items())),
            linears_kept=len(kept), linears_requantized=total - len(kept),
            block_offsets=any(spec.offsets for spec in kept.values()),
        )
        log(
            f"      quantized linears: {len(kept)} keep their GGUF blocks {quantization['source_blocks_kept'] or ''}, "
            f"{total - len(kept)} quantized from float ({quantization['method']})"
        )

    if options.kv_cache_dtype == "int8":
        calibration = options.kv_calibration
        windows = calibration_windows(_encoder(checkpoint.tokenizer), calibration, max_seq_len)
        model.use_int8_kv_cache(calibrate_kv_scales(model, windows))
        quantization["kv_cache"] = {"dtype": "int8", "scales": "static, per layer, kv head and channel",
                                    "calibration": calibration.describe()}
        log(f"      int8 KV cache, scales calibrated on {calibration.describe()}")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        step(3, "tracing the step and sampler graphs with torch.export and emitting ONNX")
        graphs = {STEP_GRAPH: _native_kernels(options, export_step_graph(model, staging, max_seq_len), staging, log)}
        del model
        graphs[SAMPLER_GRAPH] = export_sampler_graph(config.vocab_size, options.tree_depth, staging)
        if drafter is not None:
            step(4, f"exporting the ReDrafter draft graph from {draft_head_path}")
            graphs[DRAFT_GRAPH] = export_draft_graph(drafter, staging)
        if options.speculative == "draft-model":
            step(4, f"building the draft model {options.draft_model} ({options.draft_quant})")
            draft_options = _draft_model_options(options, staging / DRAFT_ENGINE, max_seq_len)
            build_engine(draft_options, log=lambda line: log(f"      draft: {line}"))
        step(total_steps, "writing tokenizer, manifest and checksums")
        (staging / TOKENIZER_FILE).write_text(checkpoint.tokenizer.tokenizer_json)
        spec = checkpoint.tokenizer
        manifest = Manifest(
            schema_version=SCHEMA_VERSION,
            builder_version=__version__,
            source=checkpoint.source,
            backend="onnxruntime",
            dtype=options.dtype,
            max_seq_len=max_seq_len,
            model=config,
            tokenizer=TokenizerInfo(TOKENIZER_FILE, spec.chat_template, spec.bos_token, spec.eos_token, spec.add_bos_token),
            graphs=graphs,
            phases=plan_phases(shapes),
            kv_cache=KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim,
                                 "int8" if options.kv_cache_dtype == "int8" else _numpy_dtype(options.dtype)),
            sampler=SamplerSpec(SAMPLER_GRAPH, options.tree_depth, TOP_LOGPROBS),
            quantization=quantization,
            speculation=speculation,
            sampling_defaults=checkpoint.sampling_defaults,
        )
        write_manifest(staging, manifest)
        open_artifact(staging)  # what we wrote must pass the runner's own validation
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)

    report = BuildReport(out=out, seconds=time.perf_counter() - start, peak_rss_mb=peak_rss_mb())
    report.files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    report.quantization = manifest.quantization
    report.speculation = manifest.speculation
    report.phases = {name: phase.describe() for name, phase in manifest.phases.items()}
    return report


def _native_kernels(options: BuildOptions, step: GraphSpec, staging: Path, log: Callable[[str], None]) -> GraphSpec:
    """The step graph with the nodes our kernels cover rewritten to them and their library beside it, or as it is
    (onnxruntime's own ops) where that cannot be had, saying why."""
    wanted = {"DecodeAttention": options.native_decode_attention, "Int4MatMul": options.native_int4_matmul}
    if not any(wanted.values()):
        return step
    reason = native_ops.unavailable_reason()
    if reason is not None:
        log(f"      kernels: onnxruntime's own ops ({reason})")
        return step
    if wanted["DecodeAttention"] and options.kv_cache_dtype == "int8":
        log("      decode attention: onnxruntime's GroupQueryAttention (the int8 KV cache is not implemented in ours)")
        wanted["DecodeAttention"] = False
    elif wanted["DecodeAttention"] and options.dtype != "fp32":
        log(f"      decode attention: onnxruntime's GroupQueryAttention (ours computes in fp32 only, not {options.dtype})")
        wanted["DecodeAttention"] = False
    if wanted["Int4MatMul"] and (cpu := int4_matmul.unavailable_reason()):
        log(f"      int4 matmuls: onnxruntime's MatMulNBits ({cpu})")
        wanted["Int4MatMul"] = False
    rewrites = {"DecodeAttention": decode_attention.use_in_graph, "Int4MatMul": int4_matmul.use_in_graph}
    used = []
    for op, rewrite in rewrites.items():
        count = rewrite(staging / step.file) if wanted[op] else 0
        if count:
            used.append(op)
            log(f"      {op}: our kernel in {count} nodes")
    if not used:
        return step
    library = native_ops.compile_library(staging)
    return replace(step, native_library=library.name, native_ops=used)


def _numpy_dtype(dtype: str) -> str:
    return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[dtype]


def _check_draft_model(options: BuildOptions, target) -> dict:
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
    return {"method": "draft-model", "engine": DRAFT_ENGINE, "source": draft.source, "draft_len": options.draft_len,
            "draft_quant": options.draft_quant, "max_tree_nodes": options.tree_nodes}


def _draft_model_options(options: BuildOptions, out: Path, max_seq_len: int) -> BuildOptions:
    """The draft model as an engine of its own: the target's shapes, chunks of up to draft_len + 1 tokens per
    verify call (a round feeds it the tokens it has not seen: the last one and the drafts just accepted)."""
    return BuildOptions(
        source=options.draft_model, out=out, dtype=options.dtype, max_seq_len=max_seq_len, max_batch=options.max_batch,
        prefill_chunk=options.prefill_chunk, quant=options.draft_quant, verify_tokens=options.draft_len + 1,
        keep_source_blocks=options.keep_source_blocks,
    )


def _load_drafter(path: Path, config, options: BuildOptions) -> tuple[BeamSearchDrafter, dict]:
    """Read and check the draft head before the long export, so a wrong head fails at once."""
    head, facts = load_draft_head(path)
    if (head.config.hidden_size, head.config.target_vocab_size) != (config.hidden_size, config.vocab_size):
        raise ValueError(
            f"draft head {path} was trained for hidden size {head.config.hidden_size} / vocab {head.config.target_vocab_size}, "
            f"this model has {config.hidden_size} / {config.vocab_size}"
        )
    if options.prompt_lookup_len < 0:
        raise ValueError("--prompt-lookup-len must be 0 (off) or more")
    if not 0 <= options.min_draft_prob < 1:
        raise ValueError("--min-draft-prob must be in [0, 1)")
    if options.draft_quant not in ("none", "int8"):
        raise ValueError(f"unknown draft quantization {options.draft_quant!r}; choose none or int8")
    if options.draft_quant == "int8":
        head.quantize(DRAFT_QUANT)
    drafter = BeamSearchDrafter(head, options.beam_width, options.draft_len)
    speculation = {
        "method": "redrafter", "graph": DRAFT_GRAPH, "beam_width": options.beam_width, "draft_len": options.draft_len,
        "draft_vocab_size": head.config.draft_vocab_size, "max_tree_nodes": options.tree_nodes,
        "draft_quant": options.draft_quant, "prompt_lookup_len": options.prompt_lookup_len,
        "max_ngram": PROMPT_LOOKUP_MAX_NGRAM, "min_ngram": PROMPT_LOOKUP_MIN_NGRAM, "min_draft_prob": options.min_draft_prob,
        "head": facts,
    }
    return drafter, speculation


def _key_values(values: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in values.items())
