"""Where a decode step's time goes, per operator type, from onnxruntime's own per-node trace.

The trace is onnxruntime's profiler output (a Chrome trace: one "model_run" event per session run, one
"<node>_kernel_time" event per node run). Profiling itself costs a few microseconds per node, so absolute times
are inflated, most for graphs with many small nodes; the shares and node counts are what to compare.
`read_trace` reads any onnxruntime session's trace (benchmarks/compare_peers.py reads onnxruntime-genai's too).
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from runner.tools.bench import greedy_fixed_length

SKIPPED_DECODE_RUNS = 4  # the first decode runs of a bucket shape pay one-time allocations


@dataclass(frozen=True)
class OpTime:
    op: str  # operator type, e.g. "MatMulNBits"
    ms_per_run: float
    nodes_per_run: float


@dataclass(frozen=True)
class RunProfile:
    runs: int  # session runs aggregated
    run_ms: float  # the session's own time per run, profiler on
    kernel_ms: float  # sum of the node kernels per run; run_ms - kernel_ms is the executor's own time
    ops: list[OpTime]  # most time first

    def lines(self, top: int = 12) -> list[str]:
        lines = [f"{'op':<34}{'ms/run':>8}{'share':>7}{'nodes/run':>11}"]
        for op in self.ops[:top]:
            lines.append(
                f"{op.op:<34}{op.ms_per_run:>8.3f}{op.ms_per_run / self.run_ms:>7.0%}{op.nodes_per_run:>11.0f}"
            )
        rest = self.ops[top:]
        if rest:
            ms = sum(op.ms_per_run for op in rest)
            lines.append(
                f"{f'{len(rest)} other op types':<34}{ms:>8.3f}{ms / self.run_ms:>7.0%}"
                f"{sum(op.nodes_per_run for op in rest):>11.0f}"
            )
        between = self.run_ms - self.kernel_ms
        lines.append(f"{'(executor, between kernels)':<34}{between:>8.3f}{between / self.run_ms:>7.0%}")
        lines.append(f"{'total per run, profiler on':<34}{self.run_ms:>8.3f}")
        return lines


def read_trace(path: str | Path, skip_runs: int) -> RunProfile:
    """Aggregate the node kernels of every run after the first `skip_runs` of one session's trace."""
    events = json.loads(Path(path).read_text())
    runs = sorted(
        (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"]
    )
    kept = runs[skip_runs:]
    if not kept:
        raise ValueError(f"the trace {path} has {len(runs)} runs, none after the first {skip_runs}")
    start = kept[0]["ts"]
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= start:
            op = event["args"]["op_name"]
            total[op] += event["dur"]
            count[op] += 1
    n = len(kept)
    ops = sorted((OpTime(op, total[op] / n / 1000, count[op] / n) for op in total), key=lambda o: -o.ms_per_run)
    return RunProfile(n, sum(r["dur"] for r in kept) / n / 1000, sum(total.values()) / n / 1000, ops)


def profile_decode(
    engine_dir: str | Path, prompt_ids: list[int], new_tokens: int, threads: int | None, max_batch: int | None = None
) -> RunProfile:
    """Profile the step graph over one batch-1 greedy generation, decode (or verify) runs only; `max_batch` as
    LLMEngine takes it (1: a lone stream never padded for batch invariance)."""
    with tempfile.TemporaryDirectory() as scratch:
        engine = LLMEngine(
            EngineArgs(engine_dir, threads=threads, max_batch=max_batch, profile_prefix=str(Path(scratch) / "trace"))
        )
        request = engine.add_request(None, prompt_ids, greedy_fixed_length(new_tokens))
        prefill_runs = 0
        while not request.output_token_ids:
            engine.step()
            prefill_runs += 1
        while not request.finished:
            engine.step()
        traces = engine.executor.backend.end_profiling()
        return read_trace(traces["step"], engine.executor.probe_runs + prefill_runs + SKIPPED_DECODE_RUNS)
