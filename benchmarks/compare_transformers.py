"""Our engine next to Hugging Face transformers (eager, fp32) on the default model, batch 1, side by side.

    python benchmarks/compare_transformers.py --engine engines-out/default [--threads 2] [--new-tokens 128]

Each contender runs in its own process (so peak RSS is its own) on the same token ids, greedy, EOS ignored,
with a warm-up and the median of several runs. Prints a table and writes benchmarks/results/transformers.json.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from importlib.metadata import version

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runner.machine import cpu_model  # noqa: E402

FIRST_TOKENS = 16  # greedy tokens compared between engines (as many as runner.bench.Timing keeps)


def timed_runs(generate, prompts: dict[str, list[int]], new_tokens: int, runs: int) -> dict:
    """`generate(ids, count)` -> (seconds to first token, seconds after it, tokens): a warm-up, then medians of
    `runs` per prompt, in the shape `runner.bench.Timing` reports ours."""
    results = {}
    for name, ids in prompts.items():
        generate(ids, 8)
        measured = [generate(ids, new_tokens) for _ in range(runs)]
        results[name] = {
            "prompt_tokens": len(ids), "new_tokens": new_tokens,
            "ttft_ms": statistics.median(m[0] for m in measured) * 1000,
            "decode_tok_s": statistics.median((len(m[2]) - 1) / m[1] for m in measured),
            "first_tokens": measured[0][2][:FIRST_TOKENS],
        }
    return results


def worker_ours(engine: str, threads: int, new_tokens: int, runs: int) -> dict:
    from engines.resources import peak_rss_mb
    from runner.bench import chat_prompts, median_timing, weight_bytes_per_step
    from runner.llm_engine import LLMEngine

    start = time.perf_counter()
    llm = LLMEngine(engine, threads=threads)
    load_s = time.perf_counter() - start
    prompts = chat_prompts(llm.codec)
    results = {name: median_timing(llm, ids, new_tokens, runs).to_dict() for name, ids in prompts.items()}
    return {"load_s": load_s, "peak_rss_mb": peak_rss_mb(), "weight_bytes": weight_bytes_per_step(llm), **results}


def worker_transformers(engine: str, threads: int, new_tokens: int, runs: int) -> dict:
    import torch
    import transformers

    from runner.bench import chat_prompts
    from builder.loaders.default import default_gguf_path
    from engines.resources import peak_rss_mb
    from runner.llm_engine import LLMEngine

    torch.set_num_threads(threads)
    codec = LLMEngine(engine, verify_checksums=False).codec  # the same token ids as ours
    prompts = chat_prompts(codec)
    path = default_gguf_path()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    load_s = time.perf_counter() - start

    def timed(ids: list[int], count: int) -> tuple[float, float, list[int]]:
        streamer_times: list[float] = []

        class Clock(transformers.generation.streamers.BaseStreamer):
            def put(self, value):
                streamer_times.append(time.perf_counter())

            def end(self):
                pass

        begin = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=count, min_new_tokens=count, do_sample=False, streamer=Clock(),
            )
        # put() is called first with the prompt, then once per new token
        first, last = streamer_times[1], streamer_times[-1]
        return first - begin, last - first, out[0, len(ids):].tolist()

    results = timed_runs(timed, prompts, new_tokens, runs)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied table counts once
    return {"load_s": load_s, "peak_rss_mb": peak_rss_mb(), "weight_bytes": weight_bytes, **results}


WORKERS = {"ours": worker_ours, "transformers": worker_transformers}


@click.command()
@click.option("--engine", required=True, type=click.Path(exists=True))
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--runs", type=int, default=3, show_default=True)
@click.option("--worker", type=click.Choice(list(WORKERS)), default=None, hidden=True)
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks" / "results" / "transformers.json")
def main(engine, threads, new_tokens, runs, worker, out) -> None:
    if worker:
        print(json.dumps(WORKERS[worker](engine, threads, new_tokens, runs)))
        return
    results = {}
    for name in WORKERS:
        proc = subprocess.run(
            [sys.executable, __file__, "--engine", engine, "--threads", str(threads), "--new-tokens", str(new_tokens),
             "--runs", str(runs), "--worker", name],
            capture_output=True, text=True, check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"{name} worker failed:\n{proc.stderr[-3000:]}")
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    ours, ref = results["ours"], results["transformers"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    machine = f"{cpu_model()}, {threads} threads"
    print(f"machine: {machine}; commit {commit}; batch 1, greedy, {new_tokens} new tokens, median of {runs}")
    print(f"{'prompt':<7} {'tokens':>6} | {'ours TTFT':>10} {'HF TTFT':>9} {'ratio':>6} | {'ours tok/s':>10} {'HF tok/s':>9} {'ratio':>6} | same first tokens")
    for name in ("short", "long"):
        a, b = ours[name], ref[name]
        print(
            f"{name:<7} {a['prompt_tokens']:>6} | {a['ttft_ms']:>8.0f}ms {b['ttft_ms']:>7.0f}ms {b['ttft_ms'] / a['ttft_ms']:>5.2f}x | "
            f"{a['decode_tok_s']:>10.1f} {b['decode_tok_s']:>9.1f} {a['decode_tok_s'] / b['decode_tok_s']:>5.2f}x | "
            f"{a['first_tokens'] == b['first_tokens']}"
        )
    print(f"peak RSS: ours {ours['peak_rss_mb']:.0f} MiB, transformers {ref['peak_rss_mb']:.0f} MiB")
    out.parent.mkdir(parents=True, exist_ok=True)
    versions = {name: version(name) for name in ("onnxruntime", "torch", "transformers", "onnx", "onnxscript")}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    out.write_text(json.dumps(
        {"machine": machine, "commit": commit, "versions": versions, "new_tokens": new_tokens, "runs": runs, "results": results},
        indent=2,
    ))


if __name__ == "__main__":
    main()
