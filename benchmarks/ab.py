"""Compare two engines in one process, their runs alternating, so slow drifts of a noisy machine hit both alike.

    python benchmarks/ab.py ENGINE_A ENGINE_B [--runs 10] [--threads 2] [--long-prompt-tokens 650]
    python benchmarks/ab.py ENGINE ENGINE --steps-a 1 --steps-b 8   # one engine, one call per step against bursts

Separate `runner bench` runs of the same engine on a shared VM differ by more than the changes worth measuring
(docs/measurements.md, Benchmark method), so an A/B needs pairs. Each round times A then B (then B then A in the
next round) on the same greedy prompt and prints the median decode tok/s and TTFT of each and the median of the
per-round ratios B/A. Both engines must be ones this runner can open (same artifact schema). Run an engine against
itself first to see the floor.
"""

from __future__ import annotations

import statistics

import click

from runner.core.args import DEFAULT_NUM_SCHEDULER_STEPS, EngineArgs
from runner.core.engine import LLMEngine
from runner.tools.bench import chat_prompts, time_generation


@click.command()
@click.argument("engine_a", type=click.Path(exists=True))
@click.argument("engine_b", type=click.Path(exists=True))
@click.option("--runs", default=10, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--new-tokens", default=128, show_default=True)
@click.option("--long-prompt-tokens", default=0, show_default=True, help="0: the short chat prompt.")
@click.option("--steps-a", default=DEFAULT_NUM_SCHEDULER_STEPS, show_default=True, help="A's num_scheduler_steps.")
@click.option("--steps-b", default=DEFAULT_NUM_SCHEDULER_STEPS, show_default=True, help="B's num_scheduler_steps.")
def main(
    engine_a: str,
    engine_b: str,
    runs: int,
    threads: int,
    new_tokens: int,
    long_prompt_tokens: int,
    steps_a: int,
    steps_b: int,
) -> None:
    # one stream, as `runner generate` and compare_peers.py run it: no padding of one-row calls for batch invariance
    engines = {
        name: LLMEngine(EngineArgs(path, threads=threads, max_batch=1, num_scheduler_steps=steps))
        for name, path, steps in (("A", engine_a, steps_a), ("B", engine_b, steps_b))
    }
    prompts = chat_prompts(engines["A"].codec, long_prompt_tokens)
    prompt = prompts["long"] if long_prompt_tokens else prompts["short"]
    for engine in engines.values():
        time_generation(engine, prompt, 16)  # warm-up
    timings = {"A": [], "B": []}
    for round_ in range(runs):
        for name in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
            timings[name].append(time_generation(engines[name], prompt, new_tokens))
    print(f"{len(prompt)}-token prompt, {new_tokens} new tokens, {runs} rounds, {threads} threads")
    for name, path in (("A", engine_a), ("B", engine_b)):
        decode = statistics.median(t.decode_tok_s for t in timings[name])
        ttft = statistics.median(t.ttft_ms for t in timings[name])
        print(
            f"{name}: decode {decode:7.1f} tok/s   TTFT {ttft:7.1f} ms   {path}, num_scheduler_steps "
            f"{engines[name].num_scheduler_steps}"
        )
    ratios = [b.decode_tok_s / a.decode_tok_s for a, b in zip(timings["A"], timings["B"])]
    ttft_ratios = [b.ttft_ms / a.ttft_ms for a, b in zip(timings["A"], timings["B"])]
    print(
        f"B/A decode: median {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}..{max(ratios):.3f}); "
        f"TTFT {statistics.median(ttft_ratios):.3f}"
    )


if __name__ == "__main__":
    main()
