"""The quantization table (docs/quantization.md) for the default model, measured side by side in one run.

    python benchmarks/quantization.py [--out-dir engines-out/quant] [--threads 2] [--runs 5]

Builds each variant with `builder build default` in its own process (build peak RSS is the build's own report),
then times all engines side by side, each in a worker process of its own with runs interleaved round-robin
(benchmarks/interleave.py: a shared VM's speed drifts over minutes): runner peak RSS, TTFT of the ~40-token
chat prompt and prefill of the ~650-token one, decode tokens/s at batch 1 (128 tokens, EOS banned, median of
`--runs`). Then perplexity of each on CPython's LICENSE.txt (window 512, stride 256; real prose nobody here wrote,
read from the interpreter's install). Writes benchmarks/results/quantization.json and prints the Markdown table.

`--untied` measures the embedding table's storage instead: the default model with its tied table copied as a
separate LM head (float, dequantized from the GGUF by transformers, in the Hugging Face layout), built with the table
in blocks of its own (the default) and with `--float-embedding`.

`--k-quants` measures a GGUF of mixed K-quant types instead: the default model as llama.cpp's Q4_K_M quantizes it
(llama-cpp-python's quantizer, from the Q4_1 file: Q4_K and Q6_K where a row's inputs are a multiple of 256, Q5_0 /
Q8_0 where not), built keeping the file's blocks (the default) and requantized to int4, next to llama.cpp running
the same file (timed and scored in the same interleaved run).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compare_peers import write_perplexity_text  # noqa: E402
from benchmarks.compare_transformers import contender_ours, write_prompts  # noqa: E402
from benchmarks.interleave import interleaved_runs, serve  # noqa: E402
from benchmarks.provenance import source_commit  # noqa: E402
from runner.core.machine import cpu_model  # noqa: E402
from runner.tools.bench import license_text  # noqa: E402

# name -> `builder build default` options. The default model is a Q4_1 GGUF: "fp32" is its blocks dequantized;
# RTN and GPTQ start from that float model; "GGUF blocks" keeps the file's own Q4_1 / Q8_0 blocks.
NEW_TOKENS = 128
VARIANTS = {
    "fp32": ["--quant", "none"],
    "int8 RTN g128": ["--quant", "int8"],
    "int4 RTN g32": ["--quant", "int4", "--requantize-gguf"],
    "int4 GPTQ g32": ["--quant", "gptq"],
    "GGUF blocks (the default)": [],
}
UNTIED_VARIANTS = {
    "fp32": ["--quant", "none"],
    "int8 RTN g128, float table": ["--quant", "int8", "--float-embedding"],
    "int8 RTN g128": ["--quant", "int8"],
    "int4 RTN g32, float table": ["--quant", "int4", "--float-embedding"],
    "int4 RTN g32": ["--quant", "int4"],
}


K_QUANT_VARIANTS = {
    "fp32": ["--quant", "none"],
    "int4 RTN g32, every weight (--requantize-gguf)": ["--quant", "int4", "--requantize-gguf"],
    "the file's blocks (the default)": [],
}
LLAMA_CPP = "llama.cpp, the same file"


def k_quants_gguf(out: Path) -> Path:
    """The default model in llama.cpp's Q4_K_M mix (its quantizer re-quantizing the Q4_1 file's weights)."""
    if out.is_file():
        return out
    import ctypes

    import llama_cpp

    from builder.loaders.default import default_gguf_path

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    out.parent.mkdir(parents=True, exist_ok=True)
    if llama_cpp.llama_model_quantize(str(default_gguf_path()).encode(), str(out).encode(), ctypes.byref(params)):
        raise SystemExit("llama.cpp's quantizer failed")
    return out


def untied_checkpoint(out: Path) -> Path:
    """The default model in the Hugging Face layout, float32, its LM head a copy of its tied embedding table."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    import transformers
    from safetensors.torch import save_file

    from builder.loaders.default import default_gguf_path

    gguf = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32
    )
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    # transformers will not save a model it read from a GGUF: its (float) tensors and config are written here
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


def perplexity_of(engine: str, threads: int) -> dict:
    from runner.core.args import EngineArgs
    from runner.core.engine import LLMEngine
    from runner.tools.evaluate import perplexity

    llm = LLMEngine(EngineArgs(engine, threads=threads, max_batch=1))  # scores one sequence
    result = perplexity(llm, llm.codec.encode(license_text()), window=512, stride=256)
    return {"perplexity": result.perplexity, "perplexity_tokens": result.tokens_scored}


def build(name: str, source: str, flags: list[str], out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "builder.cli", "build", source, "--out", str(out), "--overwrite", *flags],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise SystemExit(f"building {name} failed:\n{proc.stderr[-3000:]}")
    seconds, rss = re.search(r"built in ([\d.]+) s, peak RSS (\d+) MiB", proc.stdout).groups()
    size = sum(p.stat().st_size for p in out.iterdir())
    return {"build_s": float(seconds), "build_peak_rss_mb": float(rss), "size_mb": size / 2**20}


def table(results: dict) -> list[str]:
    fp32 = results["fp32"]
    lines = [
        "| engine | size MiB | vs fp32 | build peak RSS MiB | runner peak RSS MiB | decode tok/s | vs fp32 "
        f"| TTFT {fp32['short']['prompt_tokens']} tok ms | prefill {fp32['long']['prompt_tokens']} tok ms | perplexity "
        "| vs fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        build_rss = "-" if r.get("build_peak_rss_mb") is None else f"{r['build_peak_rss_mb']:.0f}"
        lines.append(
            f"| {name} | {r['size_mb']:.0f} | {r['size_mb'] / fp32['size_mb']:.0%} | {build_rss} "
            f"| {r['peak_rss_mb']:.0f} | {r['short']['decode_tok_s']:.1f} "
            f"| {r['short']['decode_tok_s'] / fp32['short']['decode_tok_s']:.2f}x | {r['short']['ttft_ms']:.0f} "
            f"| {r['long']['ttft_ms']:.0f} | {r['perplexity']:.3f} | {r['perplexity'] / fp32['perplexity'] - 1:+.1%} |"
        )
    return lines


@click.command()
@click.option("--out-dir", type=click.Path(path_type=Path), default=ROOT / "engines-out" / "quant", show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--runs", type=int, default=5, show_default=True)
@click.option("--worker", default=None, hidden=True, help="Serve timed runs of this engine (interleave protocol).")
@click.option("--perplexity", "perplexity_engine", default=None, hidden=True)
@click.option("--untied", is_flag=True, help="Measure an untied copy of the default model's table storage.")
@click.option("--k-quants", is_flag=True, help="Measure the default model in llama.cpp's Q4_K_M mix of types.")
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks" / "results" / "quantization.json")
def main(out_dir, threads, runs, worker, perplexity_engine, untied, k_quants, out) -> None:
    prompts_file = ROOT / "engines-out" / "benchmark-prompts.json"
    if worker:
        generate, info = contender_ours(worker, threads)
        serve(generate, info, json.loads(prompts_file.read_text()), NEW_TOKENS)
        return
    if perplexity_engine:
        print(json.dumps(perplexity_of(perplexity_engine, threads)))
        return
    variants, source = VARIANTS, "default"
    if untied:
        variants, source = UNTIED_VARIANTS, str(untied_checkpoint(out_dir / "untied-checkpoint"))
    elif k_quants:
        variants, source = K_QUANT_VARIANTS, str(k_quants_gguf(out_dir / "smollm2-135m-instruct-q4_k_m.gguf"))
    engines = {name: out_dir / re.sub(r"\W+", "-", name) for name in variants}
    results = {}
    for name, flags in variants.items():
        click.echo(f"{name}: building", err=True)
        results[name] = build(name, source, flags, engines[name])
    prompts = write_prompts(str(engines["fp32"]), prompts_file)
    workers = {
        name: [sys.executable, __file__, "--worker", str(engine), "--threads", str(threads)]
        for name, engine in engines.items()
    }
    if k_quants:  # llama.cpp through the peers benchmark's worker, on the same prompt and text ids
        (out_dir / "prompts.json").write_text(json.dumps(prompts))
        write_perplexity_text(str(engines["fp32"]), out_dir / "perplexity_text.json")
        peers = [sys.executable, str(ROOT / "benchmarks" / "compare_peers.py"), "--threads", str(threads)]
        peers += ["--ours", str(engines["fp32"]), "--work", str(out_dir), "--new-tokens", str(NEW_TOKENS)]
        peers += ["--worker-target", source]
        workers[LLAMA_CPP] = [*peers, "--worker-kind", "llama.cpp"]
        results[LLAMA_CPP] = {"size_mb": Path(source).stat().st_size / 2**20, "build_peak_rss_mb": None}
    timed = interleaved_runs(workers, prompts, runs, threads, log=lambda line: click.echo(line, err=True))
    if k_quants:
        proc = subprocess.run([*peers, "--worker-kind", "perplexity:llama.cpp"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"measuring llama.cpp's perplexity failed:\n{proc.stderr[-3000:]}")
        results[LLAMA_CPP].update(timed[LLAMA_CPP], **json.loads(proc.stdout.strip().splitlines()[-1]))
    for name, engine in engines.items():
        click.echo(f"{name}: perplexity", err=True)
        proc = subprocess.run(
            [sys.executable, __file__, "--perplexity", str(engine), "--threads", str(threads)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"measuring {name}'s perplexity failed:\n{proc.stderr[-3000:]}")
        results[name].update(timed[name], **json.loads(proc.stdout.strip().splitlines()[-1]))
    commit = source_commit()
    machine = f"{cpu_model()}, {threads} threads"
    versions = {name: version(name) for name in ("onnxruntime", "torch", "onnx")}
    model = "untied copy of the default model" if untied else "Default model"
    if k_quants:
        model = "llama.cpp's Q4_K_M of the default model"
    lines = [
        f"{model} (SmolLM2-135M-Instruct Q4_1 GGUF), {machine}, commit {commit}, batch 1, greedy, "
        f"{NEW_TOKENS} new tokens, median of {runs} interleaved runs.",
        "",
    ]
    lines += table(results)
    click.echo("\n".join(lines))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": machine,
                "commit": commit,
                "versions": versions,
                "runs": runs,
                "new_tokens": NEW_TOKENS,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
