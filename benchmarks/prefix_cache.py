"""Multi-turn chat with and without prefix caching, side by side in one process.

    python benchmarks/prefix_cache.py --engine engines-out/default [--turns 6] [--rounds 3]

A conversation opens with a ~860-token document to summarise, then asks short follow-ups; every turn sends the
whole conversation again, as chat clients do. Two engines on the same artifact, one with `enable_prefix_caching`,
take turns on the same prompts (the conversation grows with the uncached engine's answers, so both see the same
tokens). Each round is a fresh conversation (its first message is numbered, so nothing from the last round is
reused but the system prompt). Prints, per turn, prompt and cached tokens and the medians of time to first token
(TTFT) for both engines and their ratio; whether their answers agree; writes benchmarks/results/prefix_cache.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import source_commit  # noqa: E402
from runner.core.args import EngineArgs  # noqa: E402
from runner.core.engine import LLMEngine  # noqa: E402
from runner.core.machine import cpu_model, memory_bandwidth_gbs  # noqa: E402
from runner.sampling.params import SamplingParams  # noqa: E402
from runner.tools.bench import license_text  # noqa: E402

FOLLOW_UPS = [
    "Make it shorter.",
    "List three key points.",
    "Who is it written for?",
    "Translate the first point into French.",
    "What should a user do first?",
    "Give it a title.",
]


def answer(engine: LLMEngine, prompt_ids: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """Seconds to the first token, the greedy answer's token ids and the prompt tokens the prefix cache held."""
    start = time.perf_counter()
    request = engine.add_request(None, prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    first = None
    while not request.finished:
        engine.step()
        if first is None and request.output_token_ids:
            first = time.perf_counter() - start
    return first, request.output_token_ids, request.num_cached_tokens


@click.command()
@click.option("--engine", "engine_dir", default=str(ROOT / "engines-out" / "default"), show_default=True)
@click.option("--turns", default=6, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--max-tokens", default=48, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks" / "results" / "prefix_cache.json")
def main(engine_dir, turns, rounds, max_tokens, threads, out) -> None:
    engines = {
        "off": LLMEngine(EngineArgs(engine_dir, threads=threads, max_batch=1)),
        "on": LLMEngine(EngineArgs(engine_dir, threads=threads, max_batch=1, enable_prefix_caching=True)),
    }
    codec = engines["off"].codec
    document = " ".join(license_text().split()[:420])
    ttft = {name: [[] for _ in range(turns)] for name in engines}
    rows, agree = [], True
    for number in range(rounds):
        messages = [{"role": "user", "content": f"Text {number + 1}. Summarise this text:\n{document}"}]
        for turn in range(turns):
            ids = codec.encode(codec.apply_chat_template(messages))
            order = list(engines) if (number + turn) % 2 == 0 else list(reversed(engines))
            answers = {}
            for name in order:
                seconds, tokens, cached = answer(engines[name], ids, max_tokens)
                ttft[name][turn].append(seconds)
                answers[name] = tokens
                if name == "on" and number == 0:
                    rows.append({"turn": turn + 1, "prompt_tokens": len(ids), "cached_tokens": cached})
            agree &= answers["on"] == answers["off"]
            messages += [
                {"role": "assistant", "content": codec.decode(answers["off"])},
                {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]},
            ]
    for row, off, on in zip(rows, ttft["off"], ttft["on"]):
        row.update(ttft_off_ms=1000 * statistics.median(off), ttft_on_ms=1000 * statistics.median(on))
        row["speedup"] = row["ttft_off_ms"] / row["ttft_on_ms"]
    bandwidth = memory_bandwidth_gbs(threads)
    print(
        f"{cpu_model()}, {threads} threads, memory bandwidth {bandwidth:.1f} GB/s; {Path(engine_dir).name}, batch 1, "
        f"greedy answers of up to {max_tokens} tokens, median of {rounds} conversations"
    )
    print(
        "| turn | prompt tokens | cached tokens (round 1) | TTFT off ms | TTFT on ms | speed-up "
        "|\n|---:|---:|---:|---:|---:|---:|"
    )
    for row in rows:
        print(
            f"| {row['turn']} | {row['prompt_tokens']} | {row['cached_tokens']} | {row['ttft_off_ms']:.0f} | "
            f"{row['ttft_on_ms']:.0f} | {row['speedup']:.1f}x |"
        )
    print("answers identical with and without prefix caching:", "yes" if agree else "NO")
    commit = source_commit()
    out.write_text(
        json.dumps(
            {
                "machine": {"cpu": cpu_model(), "threads": threads, "bandwidth_gbs": bandwidth},
                "commit": commit,
                "engine": Path(engine_dir).name,
                "rounds": rounds,
                "max_tokens": max_tokens,
                "answers_identical": agree,
                "turns": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
