"""Our int4 engines against llama.cpp (and onnxruntime-genai) at 1B scale, where the quantized matmul itself
decides the speed: a random-weight Llama of 1B shape, made here (its quality is meaningless, its speed is not).

    python benchmarks/peers_1b.py [--work engines-out/peers-1b] [--peers llama.cpp,ort-genai] [--runs 3]
                                  [--file-type Q4_0|Q4_K_M|Q5_K_M]

1. The checkpoint: hidden 2048, 16 layers, 32 / 8 heads, intermediate 8192, vocabulary 49152 (the default model's
   tokenizer), tied embeddings, float16 safetensors in the Hugging Face layout, random with a fixed seed.
2. llama.cpp's own Q4_0 GGUF of it: its converter (convert_hf_to_gguf.py from llama-cpp-python's source
   distribution, its gguf-py on the path), then `llama_model_quantize` (Q4_0; the tied embedding as its quantizer
   picks, Q6_K). `--file-type Q4_K_M` makes llama.cpp's Q4_K_M mix instead (Q4_K, with Q6_K on half the down
   projections and value projections and on the table), the type most GGUFs people download have; `Q5_K_M` its
   5-bit sibling (Q5_K, the same Q6_K tensors).
3. Ours, built from that same GGUF (its Q4_0 / Q4_K / Q5_K / Q6_K blocks kept, a fused q/k/v whose parts have different
   types as one node per part, as the build says) and from the checkpoint (`--quant int4`, round-to-nearest);
   onnxruntime-genai's int4 CPU model from the checkpoint (its model builder, RTN block 32, accuracy level 4) where
   asked.
4. Every engine in its own process, runs interleaved round-robin (benchmarks/interleave.py), the chat prompts of
   `runner bench` (~40 and ~650 tokens), greedy, --new-tokens tokens; the memory bandwidth measured in the same run.
Each step is skipped when its output exists in --work. Writes benchmarks/results/<--name>_<commit>.{json,md}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compare_peers import PEER_PACKAGES, ensure_package, ort_genai_model  # noqa: E402
from benchmarks.compare_transformers import write_prompts  # noqa: E402
from benchmarks.interleave import interleaved_runs, paired_ratio  # noqa: E402
from benchmarks.provenance import source_commit  # noqa: E402
from runner.core.machine import cpu_model, memory_bandwidth_gbs  # noqa: E402

SHAPE = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 49152,
}


def make_checkpoint(out: Path, seed: int = 0) -> None:
    import torch
    import transformers

    from builder.loaders.default import default_gguf_path

    config = transformers.LlamaConfig(
        **SHAPE,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float16",
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).half().save_pretrained(out, safe_serialization=True)
    gguf = default_gguf_path()
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)


def llama_cpp_converter(work: Path) -> Path:
    """llama.cpp's converter from llama-cpp-python's source distribution (the installed version's)."""
    release = ensure_package("llama-cpp-python")
    source = work / f"llama_cpp_python-{release}"
    converter = source / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    if not converter.is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(work)]
            + [f"llama-cpp-python=={release}"],
            check=True,
        )
        with tarfile.open(work / f"llama_cpp_python-{release}.tar.gz") as archive:
            wanted = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in m.name and ".py" in m.name]
            archive.extractall(work, members=wanted, filter="data")
    ensure_package("sentencepiece")  # the converter imports it before it looks at the tokenizer it has
    return converter


FILE_TYPES = ("Q4_0", "Q4_K_M", "Q5_K_M")


def make_gguf(checkpoint: Path, out: Path, file_type: str, threads: int) -> Path:
    import ctypes

    import llama_cpp

    work = out.parent
    f16 = work / "model-f16.gguf"
    converter = llama_cpp_converter(work)
    subprocess.run(
        [sys.executable, str(converter), str(checkpoint), "--outtype", "f16", "--outfile", str(f16)],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(converter.parent / "gguf-py")},
    )
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise SystemExit("llama.cpp's quantizer failed")
    f16.unlink()
    return out


def build_ours(source: Path, out: Path, *options: str) -> None:
    subprocess.run(
        [sys.executable, "-c", "from builder.cli import main; main()", "build", str(source), "--out", str(out)]
        + ["--overwrite", *options],
        check=True,
        cwd=ROOT,
    )


def size_bytes(target: Path) -> int:
    return (
        target.stat().st_size if target.is_file() else sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    )


def markdown(report: dict) -> list[str]:
    lines = [
        f"# 1B shape, random weights: {report['machine']}",
        "",
        f"commit {report['commit']}, triad {report['bandwidth_gbs']:.1f} GB/s, {report['new_tokens']} new tokens, "
        f"{report['runs']} interleaved rounds",
        "",
        "| engine | size MiB | TTFT short | TTFT long | decode short | decode long | MBU short | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in report["engines"].items():
        lines.append(
            f"| {label} | {r['size_bytes'] / 2**20:.0f} | {r['short']['ttft_ms']:.0f} ms"
            f" | {r['long']['ttft_ms']:.0f} ms | {r['short']['decode_tok_s']:.1f} | {r['long']['decode_tok_s']:.1f}"
            f" | {r['mbu_short']:.0%} | {r['peak_rss_mb']:.0f} |"
        )
    lines += ["", "Paired per round (median, range), ours / peer:", ""]
    for row in report["ratios"]:
        lines.append(
            f"- {row['ours']} / {row['peer']}, {row['prompt']} {row['metric']}: "
            f"{row['median']:.2f}x ({row['low']:.2f}-{row['high']:.2f})"
        )
    return lines


@click.command()
@click.option("--work", type=click.Path(path_type=Path), default=ROOT / "engines-out" / "peers-1b", show_default=True)
@click.option("--peers", default="llama.cpp,ort-genai", show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--runs", type=int, default=3, show_default=True)
@click.option("--file-type", type=click.Choice(FILE_TYPES), default="Q4_0", show_default=True, help="llama.cpp's GGUF.")
@click.option("--name", default="peers_1b", show_default=True, help="Results file stem (the commit is appended).")
def main(work: Path, peers: str, threads: int, new_tokens: int, runs: int, file_type: str, name: str) -> None:
    wanted = [p.strip() for p in peers.split(",") if p.strip()]
    for peer in wanted:
        ensure_package(PEER_PACKAGES[peer])
    work.mkdir(parents=True, exist_ok=True)
    checkpoint, gguf = work / "hf", work / f"model-{file_type.lower()}.gguf"
    if not (checkpoint / "model.safetensors").is_file():
        click.echo("making the random 1B checkpoint", err=True)
        make_checkpoint(checkpoint)
    if not gguf.is_file():
        click.echo(f"llama.cpp: converting and quantizing to {file_type}", err=True)
        make_gguf(checkpoint, gguf, file_type, threads)
    ours = {f"ours (the GGUF's {file_type} blocks)": work / f"ours-{gguf.stem}", "ours int4 RTN g32": work / "ours-rtn"}
    for (_, engine), (source, options) in zip(ours.items(), ((gguf, ()), (checkpoint, ("--quant", "int4")))):
        if not (engine / "manifest.json").is_file():
            click.echo(f"building {engine.name}", err=True)
            build_ours(source, engine, *options)
    engines = [(label, "ours", engine) for label, engine in ours.items()]
    if "llama.cpp" in wanted:
        engines.append((f"llama.cpp {file_type}", "llama.cpp", gguf))
    if "ort-genai" in wanted:
        engines.append(
            ("ort-genai int4", "ort-genai", ort_genai_model(checkpoint, work / "ort-genai-int4", "int4", work, threads))
        )
    prompts_file = work / "prompts.json"
    prompts = write_prompts(str(ours["ours int4 RTN g32"]), prompts_file)

    def worker(kind: str, target: Path) -> list[str]:
        return [sys.executable, str(ROOT / "benchmarks" / "compare_peers.py"), "--ours", str(target)] + [
            "--threads", str(threads), "--new-tokens", str(new_tokens), "--work", str(work),
            "--worker-kind", kind, "--worker-target", str(target),
        ]  # fmt: skip

    bandwidth = memory_bandwidth_gbs(threads)
    workers = {label: worker(kind, target) for label, kind, target in engines}
    results = interleaved_runs(workers, prompts, runs, threads, log=lambda line: click.echo(line, err=True))
    for (_, _, target), r in zip(engines, results.values(), strict=True):
        r["mbu_short"] = r["weight_bytes"] * r["short"]["decode_tok_s"] / (bandwidth * 1e9)
        r["size_bytes"] = size_bytes(target)
    ratios = []
    for mine in ours:
        for peer in results:
            if peer in ours:
                continue
            for prompt in prompts:
                for metric, better in (("decode_tok_s", 1), ("ttft_ms", -1)):
                    a, b = results[mine][prompt][f"{metric}_runs"], results[peer][prompt][f"{metric}_runs"]
                    median, low, high = paired_ratio(a, b) if better > 0 else paired_ratio(b, a)
                    row = {"ours": mine, "peer": peer, "prompt": prompt, "metric": metric}
                    ratios.append(row | {"median": median, "low": low, "high": high})
    report = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {threads} threads",
        "bandwidth_gbs": bandwidth,
        "commit": source_commit(),
        "shape": SHAPE,
        "new_tokens": new_tokens,
        "runs": runs,
        "engines": results,
        "ratios": ratios,
    }
    text = "\n".join(markdown(report))
    click.echo(text)
    stem = ROOT / "benchmarks" / "results" / f"{name}_{report['commit']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
