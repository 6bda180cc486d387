"""Engines timed side by side with their runs interleaved.

Each contender runs in a worker process of its own (its own threads, its own peak RSS) that loads its engine, warms
up, and then times one generation per request. The coordinator sends the requests round-robin, rotating the order
every round, so every engine's runs spread over the whole benchmark: a machine whose speed drifts over minutes (this
project's VMs do) then favours no engine (docs/measurements.md, Benchmark method).

Worker side: `serve(generate, info, ...)`; `generate(ids, count)` -> (seconds to the first token, decode tokens/s after
it, the first greedy tokens). Coordinator side: `interleaved_runs`. Protocol lines on the worker's stdout start with
PREFIX (libraries may print there too).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

PREFIX = "@@ "
FIRST_TOKENS = 16  # greedy tokens compared between engines (as many as runner.tools.bench.Timing keeps)
SETTLE_S = 0.05  # between runs: lets the last engine's spinning threads go idle before the next one starts

Generate = Callable[[list[int], int], tuple[float, float, list[int]]]


def decode_rate(tokens: int, seconds_after_first: float) -> float:
    return (tokens - 1) / seconds_after_first


def rotated(items: list, round_: int) -> list:
    """The order of round `round_`: each round starts one later, so no contender always runs first (right after
    the others, or after a pause) in a round."""
    shift = round_ % len(items)
    return items[shift:] + items[:shift]


def paired_ratio(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    """numerator / denominator round by round -> (median, lowest, highest). Run i of every engine comes from round i,
    and the runs of a round follow one another within seconds, so a machine whose speed drifts over minutes moves
    both alike: a ratio of medians could pair one engine's fast rounds with the other's slow ones."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def serve(generate: Generate, info: dict, prompts: dict[str, list[int]], new_tokens: int) -> None:
    """Worker loop: warm up on every prompt, then answer "PROMPT_NAME" lines with one timed run and "done" with
    `info` (load time, weight bytes...) plus this process's peak RSS."""
    from engines.resources import peak_rss_mb

    for ids in prompts.values():
        generate(ids, 8)
    _say({"ready": True})
    for line in sys.stdin:
        name = line.strip()
        if name == "done":
            _say({**info, "peak_rss_mb": peak_rss_mb()})
            return
        ttft_s, decode_tok_s, tokens = generate(prompts[name], new_tokens)
        _say({"ttft_s": ttft_s, "decode_tok_s": decode_tok_s, "tokens": tokens[:FIRST_TOKENS]})


def _say(message: dict) -> None:
    print(PREFIX + json.dumps(message), flush=True)


class Worker:
    def __init__(self, label: str, argv: list[str], threads: int) -> None:
        self.label = label
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        )

    def receive(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])
        raise SystemExit(f"{self.label} worker failed:\n{self.process.stderr.read()[-3000:]}")

    def ask(self, request: str) -> dict:
        self.process.stdin.write(request + "\n")
        self.process.stdin.flush()
        return self.receive()


def interleaved_runs(
    workers: dict[str, list[str]],
    prompts: dict[str, list[int]],
    runs: int,
    threads: int,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, dict]:
    """`workers`: label -> the command that starts its worker. Starts them all, times `runs` rounds of every prompt
    round-robin, and returns per label: medians per prompt (TTFT, decode tok/s, first tokens) and the worker's info."""
    started = {label: Worker(label, argv, threads) for label, argv in workers.items()}
    for worker in started.values():
        worker.receive()  # loaded and warmed up
        log(f"{worker.label}: ready")
    measured: dict[str, dict[str, list[dict]]] = {label: {name: [] for name in prompts} for label in workers}
    labels = list(workers)
    for round_ in range(runs):
        for name in prompts:
            for label in rotated(labels, round_):
                time.sleep(SETTLE_S)
                measured[label][name].append(started[label].ask(name))
        log(f"round {round_ + 1}/{runs} done")
    results = {}
    for label, worker in started.items():
        results[label] = worker.ask("done")
        worker.process.wait()
        for name, ids in prompts.items():
            runs_of = measured[label][name]
            results[label][name] = {
                "prompt_tokens": len(ids),
                "runs": len(runs_of),
                "ttft_ms": statistics.median(r["ttft_s"] for r in runs_of) * 1000,
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs_of),
                "first_tokens": runs_of[0]["tokens"],
                # run i of every engine is from round i: pairs of engines compare round by round (paired_ratio)
                "ttft_ms_runs": [r["ttft_s"] * 1000 for r in runs_of],
                "decode_tok_s_runs": [r["decode_tok_s"] for r in runs_of],
            }
    return results
