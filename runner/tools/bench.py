"""Measure an engine alone on this machine (`runner bench`): time to first token for a short and a long chat
prompt, decode tokens/s at batch 1 and at several batch sizes, and MBU against the memory bandwidth measured in the
same run.

The long prompt's text is the CPython licence shipped with every CPython installation (read at run time, not
copied into this repository): real prose that nobody on this project wrote. The benchmarks under benchmarks/ use
the same prompts, so their numbers and `runner bench`'s are comparable.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from runner.core.engine import LLMEngine
from runner.core.tokenizer import TextCodec
from runner.sampling.params import SamplingParams

SHORT_QUESTION = "What is the capital of France?"
_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def license_text() -> str:
    for candidate in (
        Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "LICENSE.txt",
        Path(sys.base_prefix) / "LICENSE.txt",
    ):
        if candidate.is_file():
            return candidate.read_text()
    raise FileNotFoundError("no CPython LICENSE.txt found for the long benchmark prompt")


def chat_prompts(
    codec: TextCodec, long_tokens: int = 650, question: str = SHORT_QUESTION, chat: bool = True
) -> dict[str, list[int]]:
    """Token ids of a short turn and a long one ("Summarise this text:" + the licence's first words, the first
    length that comes to at least `long_tokens` tokens; none if 0), in the engine's chat template unless `chat` is
    False."""

    def templated(content: str) -> list[int]:
        return codec.encode(codec.apply_chat_template([{"role": "user", "content": content}]) if chat else content)

    def summarise(words: int) -> list[int]:
        return templated("Summarise this text:\n" + " ".join(text[:words]))

    prompts = {"short": templated(question)}
    if long_tokens:
        text = license_text().split()
        low, high = 1, len(text)  # bisect for the fewest words that reach long_tokens
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if len(summarise(middle)) >= long_tokens else (middle + 1, high)
        prompts["long"] = summarise(low)
    return prompts


@dataclass(frozen=True)
class Timing:
    prompt_tokens: int
    new_tokens: int
    ttft_ms: float  # prefill of the whole prompt + first token
    decode_tok_s: float  # tokens after the first, per second
    first_tokens: list[int]
    decode_steps_per_s: float = (
        0.0  # decode graph calls after the first token (one weight read each; < tokens/s if speculative)
    )

    def to_dict(self) -> dict:
        return asdict(self)


def greedy_fixed_length(new_tokens: int) -> SamplingParams:
    # EOS banned until the last token (min_tokens), as peers do with "ignore EOS", so every run is equally long
    return SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0)


def time_generation(engine: LLMEngine, prompt_ids: list[int], new_tokens: int) -> Timing:
    start = time.perf_counter()
    request = engine.add_request(None, prompt_ids, greedy_fixed_length(new_tokens))
    first = None
    while not request.finished:
        engine.step()
        if first is None and request.output_token_ids:
            first, calls_before = time.perf_counter(), engine.executor.step_calls
    seconds = time.perf_counter() - first
    steps = engine.executor.step_calls - calls_before
    decoded = len(request.output_token_ids) - 1
    return Timing(
        len(prompt_ids),
        len(request.output_token_ids),
        (first - start) * 1000,
        decoded / seconds if decoded else 0.0,
        request.output_token_ids[:16],
        steps / seconds if steps else 0.0,
    )


def median_timing(engine: LLMEngine, prompt_ids: list[int], new_tokens: int, runs: int) -> Timing:
    time_generation(engine, prompt_ids, min(new_tokens, 8))  # warm-up
    timings = [time_generation(engine, prompt_ids, new_tokens) for _ in range(runs)]
    return Timing(
        timings[0].prompt_tokens,
        timings[0].new_tokens,
        statistics.median(t.ttft_ms for t in timings),
        statistics.median(t.decode_tok_s for t in timings),
        timings[0].first_tokens,
        statistics.median(t.decode_steps_per_s for t in timings),
    )


@dataclass(frozen=True)
class BatchRate:
    batch: int
    decode_tok_s: float  # tokens of all rows together, per second
    steps_per_s: float  # decode graph calls (one weight read each) per second, while every row decodes


def time_batch_decode(engine: LLMEngine, prompt_ids: list[int], batch: int, new_tokens: int) -> BatchRate:
    """`batch` copies of one request decoded together: the window runs from the step after which every row has
    its first token (prefills done; rows prefilled earlier have decoded a few tokens meanwhile) to the first row
    that finishes, so every decode call in it decodes all `batch` rows."""
    requests = [engine.add_request(None, prompt_ids, greedy_fixed_length(new_tokens)) for _ in range(batch)]
    while not all(r.output_token_ids for r in requests):
        engine.step()
    produced = sum(len(r.output_token_ids) for r in requests)
    calls_before = engine.executor.step_calls
    start = time.perf_counter()
    while not any(r.finished for r in requests):
        engine.step()
    seconds = time.perf_counter() - start
    steps = engine.executor.step_calls - calls_before
    decoded = sum(len(r.output_token_ids) for r in requests) - produced
    while not all(r.finished for r in requests):
        engine.step()
    if not steps:
        raise ValueError(
            f"{new_tokens} new tokens are too few at batch {batch}: the first row finishes before the "
            "last one is prefilled"
        )
    return BatchRate(batch, decoded / seconds, steps / seconds)


def median_batch_rate(engine: LLMEngine, prompt_ids: list[int], batch: int, new_tokens: int, runs: int) -> BatchRate:
    time_batch_decode(engine, prompt_ids, batch, new_tokens)  # warm-up: this batch bucket's first calls
    rates = [time_batch_decode(engine, prompt_ids, batch, new_tokens) for _ in range(runs)]
    return BatchRate(
        batch, statistics.median(r.decode_tok_s for r in rates), statistics.median(r.steps_per_s for r in rates)
    )


def weight_bytes_per_step(engine: LLMEngine) -> int:
    """Weight bytes one decode step of the target reads: its external-data file (the builder writes every weight
    there; the few inline initializers are norm-sized) or its compiled package (AOTInductor's .pt2, TensorRT's
    .plan: the weights and, a few MiB, the compiled code), less the embedding table, of which a step reads one row
    per token - unless the table is also the tied LM head (unquantized, or its blocks read as the table, when
    there is no separate table). Not counted: KV-cache reads (at batch 1
    and a few hundred positions a small fraction of the weights) and a ReDrafter head's own graph."""
    manifest = engine.manifest
    total = sum(entry.size for name, entry in manifest.files.items() if name.endswith((".data", ".pt2", ".plan")))
    model = manifest.model
    quantization = manifest.quantization
    embedding_is_head = model.tie_word_embeddings and (not quantization.lm_head or quantization.embedding_from_head)
    if quantization.embedding is not None:
        total -= quantization.embedding.bytes  # a table in blocks of its own
    elif not embedding_is_head:
        total -= model.vocab_size * model.hidden_size * _DTYPE_BYTES[manifest.dtype]  # a float table
    return total


def generation_batch_sizes(engine: LLMEngine) -> list[int]:
    """The batch sizes `runner bench` times by default: 1, 2, 4, ... and the runner's row limit (the engine has a
    bucket for every size up to 16)."""
    rows = engine.scheduler.max_rows
    return sorted({*(2**i for i in range(rows.bit_length())), rows})


@dataclass(frozen=True)
class BenchReport:
    machine: str
    threads: int
    bandwidth_gbs: float  # STREAM triad, measured after the engine's runs (its arrays stay out of peak RSS)
    weight_bytes: int  # read per decode step, see weight_bytes_per_step
    prompts: dict[str, Timing]  # batch 1: "short", "long"
    batches: list[BatchRate]  # the short prompt, every row decoding
    peak_rss_mb: float
    speculation: dict | None  # method, beams, tokens per verify step and time shares; None for a plain engine
    lone_row_padded: bool  # batch 1 ran as two rows (Executor.pad_single_rows_if_they_round_differently)

    def mbu(self, steps_per_s: float) -> float:
        """Model bandwidth utilisation: weight bytes read per step x steps per second / measured bandwidth."""
        return self.weight_bytes * steps_per_s / (self.bandwidth_gbs * 1e9)

    def to_dict(self) -> dict:
        return asdict(self)


def bench_engine(
    engine: LLMEngine, prompts: dict[str, list[int]], batch_sizes: list[int], new_tokens: int, runs: int, threads: int
) -> BenchReport:
    from engines.resources import peak_rss_mb
    from runner.core.machine import cpu_model, memory_bandwidth_gbs

    timings = {"short": median_timing(engine, prompts["short"], new_tokens, runs)}
    # read here, the short prompt's steps only: report_lines compares them with its step time, and the batch
    # sweep's verify calls serve several rows, which would blur the per-step shares
    stats = engine.speculation_stats
    speculation = None
    if engine.speculation is not None and stats.verify_steps:
        speculation = {
            "method": str(engine.speculation.method),
            "beam_width": engine.speculation.beam_width,
            "draft_len": engine.speculation.draft_len,
            "max_verify_nodes": engine.max_verify_nodes,
            "tokens_per_verify_step": stats.mean_accepted,
            "draft_ms_per_step": 1000 * stats.draft_seconds / stats.verify_steps,
            "verify_ms_per_step": 1000 * stats.verify_seconds / stats.verify_steps,
        }
    timings.update(
        {name: median_timing(engine, ids, new_tokens, runs) for name, ids in prompts.items() if name != "short"}
    )
    batches = [median_batch_rate(engine, prompts["short"], batch, new_tokens, runs) for batch in batch_sizes]
    peak = peak_rss_mb()
    return BenchReport(
        f"{cpu_model()}, {os.cpu_count()} cores",
        threads,
        memory_bandwidth_gbs(threads),
        weight_bytes_per_step(engine),
        timings,
        batches,
        peak,
        speculation,
        engine.executor.min_rows > 1,
    )


def report_lines(report: BenchReport) -> list[str]:
    lines = [
        f"machine: {report.machine}, {report.threads} threads, memory bandwidth {report.bandwidth_gbs:.1f} GB/s "
        f"(STREAM triad); {report.weight_bytes / 2**20:.1f} MiB of weights read per decode step",
        "",
        f"{'prompt':<8}{'tokens':>8}{'TTFT ms':>10}{'decode tok/s':>14}{'MBU':>7}",
    ]
    for name, t in report.prompts.items():
        lines.append(
            f"{name:<8}{t.prompt_tokens:>8}{t.ttft_ms:>10.1f}{t.decode_tok_s:>14.1f}"
            f"{report.mbu(t.decode_steps_per_s):>7.0%}"
        )
    lines += ["", f"{'batch':<8}{'decode tok/s':>14}{'per row':>10}{'steps/s':>10}{'MBU':>7}"]
    for b in report.batches:
        lines.append(
            f"{b.batch:<8}{b.decode_tok_s:>14.1f}{b.decode_tok_s / b.batch:>10.1f}{b.steps_per_s:>10.1f}"
            f"{report.mbu(b.steps_per_s):>7.0%}"
        )
    if report.lone_row_padded:
        lines.append(
            "(batch 1 ran as two rows: on this machine the engine's matmuls round one row differently from several)"
        )
    lines += ["", f"peak RSS {report.peak_rss_mb:.0f} MiB"]
    spec = report.speculation
    if spec is not None:
        step_ms = 1000 / report.prompts["short"].decode_steps_per_s
        draft_ms, verify_ms = spec["draft_ms_per_step"], spec["verify_ms_per_step"]
        trees = f"trees of at most {spec['max_verify_nodes']} nodes" if spec["max_verify_nodes"] else "whole trees"
        lines.append(
            f"speculation ({spec['method']}, {spec['beam_width']} beams x {spec['draft_len']}, {trees}), batch 1: "
            f"{spec['tokens_per_verify_step']:.2f} tokens per verify step; per step {step_ms:.1f} ms = draft "
            f"{draft_ms:.1f} ms ({draft_ms / step_ms:.0%}) + verify {verify_ms:.1f} ms ({verify_ms / step_ms:.0%}) + "
            "host"
        )
    return lines
