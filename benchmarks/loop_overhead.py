"""The Python around each decode step: our engine's greedy decode against a bare loop over the same bound decode
graph, which only rebinds the attention bias and feeds the step's argmax back as the next token, their runs
alternating in one process so that the machine's drift cancels.

It bounds what trimming the engine's Python could gain: the bare loop is the least a Python loop over this graph
does per token (no scheduler, no sampler, no detokenizer, no stop checks), so the engine can at most reach its
speed. Both times come from the same clock around the graph call: the gap is the median time from the end of one
decode call to the start of the next.

    python benchmarks/loop_overhead.py --engine engines-out/int4-rtn [--rounds 8] [--prompt short]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runner.bench import greedy_fixed_length, time_generation  # noqa: E402
from runner.llm_engine import LLMEngine  # noqa: E402


@dataclass(frozen=True)
class LoopRun:
    decode_tok_s: float
    gap_us: float  # median time between the end of one decode graph call and the start of the next
    tokens: list[int]


class GraphCallClock:
    """Times every call of a session's run_with_iobinding (the engine's decode calls and the bare loop's alike)."""

    def __init__(self, session) -> None:
        self.calls: list[tuple[float, float]] = []
        run = session.run_with_iobinding

        def timed(*args, **kwargs):
            start = time.perf_counter()
            run(*args, **kwargs)
            self.calls.append((start, time.perf_counter()))

        session.run_with_iobinding = timed

    def median_gap_us(self, calls: list[tuple[float, float]]) -> float:
        return statistics.median(b[0] - a[1] for a, b in zip(calls, calls[1:])) * 1e6


class BareDecodeLoop:
    """The engine's decode graph bound once on cache row 0, with every input but the attention bias (whose length
    grows each step) in arrays refilled in place, and its outputs in fixed arrays."""

    def __init__(self, engine: LLMEngine) -> None:
        executor = engine.executor
        model = engine.manifest.model
        keys, values = executor.cache.views(0, 1)
        self.arrays = {f"{kind}_{part}.{i}": buffer for i, (k, v) in enumerate(zip(keys, values))
                       for part, buffer in (("key", k), ("value", v)) for kind in ("past", "present")}
        self.arrays |= {name: np.zeros(shape, np.int64) for name, shape in
                        (("input_ids", (1, 1)), ("positions", (1, 1)), ("past_lens", 1), ("logits_index", (1, 1)))}
        self.arrays["query_lens"] = np.ones(1, np.int64)
        self.arrays |= {"logits": np.empty((1, 1, model.vocab_size), np.float32), "argmax": np.empty((1, 1), np.int64),
                        "hidden": np.empty((1, 1, model.hidden_size), np.float32)}
        bound = executor.backend.bind(executor.decode_phase.graph, self.arrays)  # by address, for good
        self.session, self.binding = bound.session, bound.binding
        self.zero_bias = np.zeros(engine.max_seq_len + 1, np.float32)

    def decode(self, token: int, position: int, count: int) -> list[int]:
        """`count` greedy tokens after `token` at `position` (that many cached in row 0)."""
        a = self.arrays
        a["input_ids"][0, 0] = token
        tokens = []
        for position in range(position, position + count):
            a["positions"][0, 0] = a["past_lens"][0] = position
            self.binding.bind_input("attention_bias", "cpu", 0, np.float32, [1, 1, 1, position + 1], self.zero_bias.ctypes.data)
            self.session.run_with_iobinding(self.binding)
            a["input_ids"][0, 0] = a["argmax"][0, 0]
            tokens.append(int(a["argmax"][0, 0]))
        return tokens


def engine_run(engine: LLMEngine, clock: GraphCallClock, ids: list[int], count: int) -> LoopRun:
    clock.calls.clear()
    timing = time_generation(engine, ids, count)
    decode_calls = clock.calls[1:]  # the first call is the prompt's
    return LoopRun(timing.decode_tok_s, clock.median_gap_us(decode_calls), list(timing.first_tokens))


def bare_run(engine: LLMEngine, loop: BareDecodeLoop, clock: GraphCallClock, ids: list[int], count: int) -> LoopRun:
    """The prompt and first token through the engine, then `count - 1` tokens by the bare loop."""
    request = engine.add_request(None, ids, greedy_fixed_length(count))
    while not request.output_token_ids:
        engine.step()
    clock.calls.clear()
    start = time.perf_counter()
    tokens = loop.decode(request.output_token_ids[-1], request.num_computed, count - 1)
    seconds = time.perf_counter() - start
    engine.abort(request)
    return LoopRun((count - 1) / seconds, clock.median_gap_us(clock.calls), (request.output_token_ids + tokens)[:16])


def loop_overhead(engine_dir: str, ids: list[int], rounds: int, new_tokens: int, threads: int | None) -> dict:
    engine = LLMEngine(engine_dir, threads=threads, max_batch=1)
    loop = BareDecodeLoop(engine)
    clock = GraphCallClock(loop.session)
    engine_run(engine, clock, ids, 16)  # warm-up, both
    bare_run(engine, loop, clock, ids, 16)
    runs: dict[str, list[LoopRun]] = {"engine": [], "bare": []}
    for round_ in range(rounds):
        for name in ("engine", "bare") if round_ % 2 == 0 else ("bare", "engine"):
            run = engine_run(engine, clock, ids, new_tokens) if name == "engine" else bare_run(engine, loop, clock, ids, new_tokens)
            runs[name].append(run)
    if runs["engine"][0].tokens != runs["bare"][0].tokens:
        raise SystemExit(f"the bare loop's greedy tokens differ from the engine's: {runs['bare'][0].tokens} "
                         f"against {runs['engine'][0].tokens}")
    ratios = [b.decode_tok_s / e.decode_tok_s for e, b in zip(runs["engine"], runs["bare"])]
    return {
        name: {"decode_tok_s": statistics.median(r.decode_tok_s for r in rs), "gap_us": statistics.median(r.gap_us for r in rs),
               "runs": [asdict(r) for r in rs]}
        for name, rs in runs.items()
    } | {"bare_over_engine": statistics.median(ratios), "lowest": min(ratios), "highest": max(ratios), "rounds": rounds}


@click.command()
@click.option("--engine", required=True, type=click.Path(exists=True))
@click.option("--prompt", type=click.Choice(["short", "long"]), default="short", show_default=True)
@click.option("--rounds", type=int, default=8, show_default=True)
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Also write the result as JSON.")
def main(engine, prompt, rounds, new_tokens, threads, out) -> None:
    from runner.bench import chat_prompts
    from runner.machine import cpu_model

    ids = chat_prompts(LLMEngine(engine, verify_checksums=False).codec)[prompt]
    result = loop_overhead(engine, ids, rounds, new_tokens, threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result |= {"engine_dir": engine, "prompt": prompt, "prompt_tokens": len(ids), "machine": f"{cpu_model()}, {threads} threads",
               "commit": commit}
    print(f"{engine}, {prompt} prompt ({len(ids)} tokens), {result['machine']}, commit {commit}, {rounds} alternating rounds "
          f"of {new_tokens} greedy tokens")
    for name in ("engine", "bare"):
        print(f"  {name:6s} {result[name]['decode_tok_s']:7.1f} tok/s, {result[name]['gap_us']:5.0f} us between decode calls")
    print(f"  bare loop / engine: {result['bare_over_engine']:.3f}x paired ({result['lowest']:.3f}-{result['highest']:.3f}x)")
    if out:
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
