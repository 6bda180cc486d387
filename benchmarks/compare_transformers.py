"""Our engine next to Hugging Face transformers (eager, fp32) on the default model, batch 1, side by side.

    python benchmarks/compare_transformers.py --engine engines-out/default [--threads 2] [--new-tokens 128]

Each contender runs in its own process (so peak RSS is its own) on the same token ids, greedy, EOS suppressed,
warmed up, with its runs interleaved with the other's (benchmarks/interleave.py) and the median taken. Prints a
table and writes benchmarks/results/transformers.json.
"""

from __future__ import annotations

import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.interleave import Generate, decode_rate, interleaved_runs, serve  # noqa: E402
from benchmarks.provenance import source_commit  # noqa: E402
from runner.core.machine import cpu_model  # noqa: E402


def contender_ours(engine: str, threads: int) -> tuple[Generate, dict]:
    from runner.core.args import EngineArgs
    from runner.core.engine import LLMEngine
    from runner.tools.bench import time_generation, weight_bytes_per_step

    start = time.perf_counter()
    llm = LLMEngine(
        EngineArgs(engine, threads=threads, max_batch=1)
    )  # one stream, as `runner generate` runs it: no batch padding
    load_s = time.perf_counter() - start

    def generate(ids: list[int], count: int) -> tuple[float, float, list[int]]:
        timing = time_generation(llm, ids, count)
        return timing.ttft_ms / 1000, timing.decode_tok_s, timing.first_tokens

    return generate, {"load_s": load_s, "weight_bytes": weight_bytes_per_step(llm)}


def load_transformers_model(threads: int):
    """The default model's GGUF in transformers, dequantized to fp32, eager, on `threads` threads."""
    import torch
    import transformers

    from builder.loaders.default import default_gguf_path

    torch.set_num_threads(threads)
    path = default_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def contender_transformers(engine: str, threads: int) -> tuple[Generate, dict]:
    import torch
    import transformers

    start = time.perf_counter()
    model = load_transformers_model(threads)
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
                torch.tensor([ids]),
                max_new_tokens=count,
                min_new_tokens=count,
                do_sample=False,
                streamer=Clock(),
            )
        # put() is called first with the prompt, then once per new token
        first, last = streamer_times[1], streamer_times[-1]
        tokens = out[0, len(ids) :].tolist()
        return first - begin, decode_rate(len(tokens), last - first), tokens

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied table counts once
    return timed, {"load_s": load_s, "weight_bytes": weight_bytes}


CONTENDERS = {"ours": contender_ours, "transformers": contender_transformers}


def write_prompts(engine: str, path: Path) -> dict[str, list[int]]:
    """The benchmark's chat prompts as our engine's tokenizer encodes them: every contender gets these ids."""
    from runner.core.args import EngineArgs
    from runner.core.engine import LLMEngine
    from runner.tools.bench import chat_prompts

    prompts = chat_prompts(LLMEngine(EngineArgs(engine, verify_checksums=False)).codec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prompts))
    return prompts


@click.command()
@click.option("--engine", required=True, type=click.Path(exists=True))
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--runs", type=int, default=5, show_default=True)
@click.option("--worker", type=click.Choice(list(CONTENDERS)), default=None, hidden=True)
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks" / "results" / "transformers.json")
def main(engine, threads, new_tokens, runs, worker, out) -> None:
    prompts_file = ROOT / "engines-out" / "benchmark-prompts.json"
    if worker:
        generate, info = CONTENDERS[worker](engine, threads)
        serve(generate, info, json.loads(prompts_file.read_text()), new_tokens)
        return
    prompts = write_prompts(engine, prompts_file)
    workers = {
        name: [
            sys.executable,
            __file__,
            "--engine",
            engine,
            "--threads",
            str(threads),
            "--new-tokens",
            str(new_tokens),
            "--worker",
            name,
        ]
        for name in CONTENDERS
    }
    results = interleaved_runs(workers, prompts, runs, threads, log=lambda line: click.echo(line, err=True))
    ours, ref = results["ours"], results["transformers"]
    commit = source_commit()
    machine = f"{cpu_model()}, {threads} threads"
    print(f"machine: {machine}; commit {commit}; batch 1, greedy, {new_tokens} new tokens, median of {runs}")
    print(
        f"{'prompt':<7} {'tokens':>6} | {'ours TTFT':>10} {'HF TTFT':>9} {'ratio':>6} | {'ours tok/s':>10} "
        f"{'HF tok/s':>9} {'ratio':>6} | same first tokens"
    )
    for name in ("short", "long"):
        a, b = ours[name], ref[name]
        print(
            f"{name:<7} {a['prompt_tokens']:>6} | {a['ttft_ms']:>8.0f}ms {b['ttft_ms']:>7.0f}ms "
            f"{b['ttft_ms'] / a['ttft_ms']:>5.2f}x | "
            f"{a['decode_tok_s']:>10.1f} {b['decode_tok_s']:>9.1f} {a['decode_tok_s'] / b['decode_tok_s']:>5.2f}x | "
            f"{a['first_tokens'] == b['first_tokens']}"
        )
    print(f"peak RSS: ours {ours['peak_rss_mb']:.0f} MiB, transformers {ref['peak_rss_mb']:.0f} MiB")
    out.parent.mkdir(parents=True, exist_ok=True)
    versions = {name: version(name) for name in ("onnxruntime", "torch", "transformers", "onnx", "onnxscript")}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    out.write_text(
        json.dumps(
            {
                "machine": machine,
                "commit": commit,
                "versions": versions,
                "new_tokens": new_tokens,
                "runs": runs,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
