"""The plain engine next to a speculative one of the same model, side by side in one process, batch 1, greedy.

    python benchmarks/speculative.py --plain engines-out/default --speculative engines-out/default-redrafter

Chat prompts here use templates and topics the shipped draft head never saw (builder/drafter_prompts.py), plus
one long summarisation prompt (~650 tokens, reported apart: prompt lookup's case). Each prompt runs on both engines
alternately (a warm-up first), answers end at EOS or --new-tokens; decode speed is tokens after the first over the
time after the first token; the overall figures are over the chat prompts. Prints per-prompt and overall numbers, checks that the
outputs are identical, and writes benchmarks/results/speculative.json.
"""

from __future__ import annotations

import copy
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HELD_OUT_PROMPTS = [
    "What is the capital of France?",
    "Describe how a rainbow forms.",
    "Write a haiku about autumn leaves.",
    "How do I make a good cup of tea?",
    "What are some fun things to do on a rainy day?",
    "Explain why the sky is blue.",
    "Give me a recipe for a simple vegetable soup.",
    "What is the difference between weather and climate?",
    "Tell me about the life of honeybees in winter.",
    "How can I become a better listener?",
]


def timed(engine, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    from runner.sampling import SamplingParams

    request = engine.add_request(None, prompt_ids, SamplingParams(max_tokens=new_tokens, temperature=0.0))
    start = time.perf_counter()
    first = None
    while not request.finished:
        engine.step()
        if first is None and request.output_token_ids:
            first = time.perf_counter()
    return list(request.output_token_ids), (first - start) * 1000, time.perf_counter() - first


@click.command()
@click.option("--plain", "plain_dir", required=True, type=click.Path(exists=True))
@click.option("--speculative", "spec_dir", required=True, type=click.Path(exists=True))
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--runs", type=int, default=2, show_default=True, help="Timed runs per prompt and engine (median).")
@click.option("--out", type=click.Path(), default=str(ROOT / "benchmarks" / "results" / "speculative.json"), show_default=True)
def main(plain_dir, spec_dir, threads, new_tokens, runs, out) -> None:
    from runner.bench import chat_prompts
    from runner.llm_engine import LLMEngine

    plain, spec = LLMEngine(plain_dir, threads=threads), LLMEngine(spec_dir, threads=threads)
    if spec.speculation is None:
        raise click.UsageError(f"{spec_dir} is not a speculative engine")
    def compare(kind: str, label: str, ids: list[int]) -> dict:
        timed(plain, ids, 8), timed(spec, ids, 8)  # warm-up
        results = {"plain": [], "speculative": []}
        before = (spec.speculation_stats.verify_steps, spec.speculation_stats.emitted_tokens)
        for _ in range(runs):
            for name, engine in (("plain", plain), ("speculative", spec)):
                results[name].append(timed(engine, ids, new_tokens))
        steps = spec.speculation_stats.verify_steps - before[0]
        emitted = spec.speculation_stats.emitted_tokens - before[1]
        tokens = {name: r[0][0] for name, r in results.items()}
        row = {"kind": kind, "prompt": label, "prompt_tokens": len(ids), "new_tokens": len(tokens["plain"]),
               "identical": tokens["plain"] == tokens["speculative"], "tokens_per_verify_step": emitted / steps if steps else 0.0}
        for name, r in results.items():
            row[f"{name}_decode_s"] = statistics.median(x[2] for x in r)
            row[f"{name}_decode_tok_s"] = (len(r[0][0]) - 1) / row[f"{name}_decode_s"]
            row[f"{name}_ttft_ms"] = statistics.median(x[1] for x in r)
        print(f"{label[:44]:<46} {row['new_tokens']:>4} tok  plain {row['plain_decode_tok_s']:6.1f} tok/s  "
              f"spec {row['speculative_decode_tok_s']:6.1f} tok/s  x{row['speculative_decode_tok_s'] / row['plain_decode_tok_s']:.2f}  "
              f"{row['tokens_per_verify_step']:.2f} tok/step  {'identical' if row['identical'] else 'DIFFERENT'}")
        return row

    rows = []
    for question in HELD_OUT_PROMPTS:
        rows.append(compare("chat", question, plain.codec.encode(plain.codec.apply_chat_template([{"role": "user", "content": question}]))))
    chat_stats = copy.deepcopy(spec.speculation_stats)
    rows.append(compare("summary", "Summarise this text: <CPython licence>", chat_prompts(plain.codec)["long"]))
    chat_rows = [r for r in rows if r["kind"] == "chat"]
    totals = {name: [sum(r["new_tokens"] - 1 for r in chat_rows), sum(r[f"{name}_decode_s"] for r in chat_rows)]
              for name in ("plain", "speculative")}
    all_identical = all(r["identical"] for r in rows)

    stats = chat_stats
    plain_rate, spec_rate = (totals[n][0] / totals[n][1] for n in ("plain", "speculative"))
    summary = {
        "plain_decode_tok_s": plain_rate,
        "speculative_decode_tok_s": spec_rate,
        "speed_up": spec_rate / plain_rate,
        "tokens_per_verify_step": stats.mean_accepted,
        "accepted_drafts_histogram": stats.accepted_histogram,
        "draft_seconds_per_step_ms": 1000 * stats.draft_seconds / max(stats.verify_steps, 1),
        "verify_seconds_per_step_ms": 1000 * stats.verify_seconds / max(stats.verify_steps, 1),
        "all_identical": all_identical,
    }
    print(f"chat prompts overall: plain {plain_rate:.1f} tok/s, speculative {spec_rate:.1f} tok/s, speed-up x{summary['speed_up']:.2f}, "
          f"{stats.mean_accepted:.2f} tokens per verify step, draft {summary['draft_seconds_per_step_ms']:.1f} ms + verify "
          f"{summary['verify_seconds_per_step_ms']:.1f} ms per step, outputs {'identical' if all_identical else 'DIFFERENT'}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    record = {
        "commit": commit, "machine": {"cpu": cpu, "threads": threads}, "plain": plain_dir, "speculative": spec_dir,
        "speculation": {k: v for k, v in spec.speculation.items() if k != "head"}, "new_tokens": new_tokens, "runs": runs,
        "summary": summary, "prompts": rows,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
