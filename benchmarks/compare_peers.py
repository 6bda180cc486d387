"""Our engines next to the engines users would pick instead, on the default model, side by side in one run.

    python benchmarks/compare_peers.py --ours engines-out/default --ours engines-out/quant/int4-GGUF-blocks-g32

Every engine runs in its own process on the same machine, with the same thread count, on the same token ids (the
~40- and ~650-token chat prompts of runner/tools/bench.py, as `runner bench` uses), greedy, a fixed number of new tokens
with EOS suppressed, a warm-up, then --runs timed runs per prompt (medians), interleaved round-robin across all
engines so that the machine's drift favours none (benchmarks/interleave.py). Peers are installed on demand, not
project dependencies:
- transformers, fp32 eager, loading the GGUF (dequantized);
- llama.cpp (llama-cpp-python, compiled from source by pip: ~10 minutes here) on the GGUF itself (Q4_1);
- onnxruntime-genai fp32 and int4 (its model builder's CPU models, int4 = RTN block 32, accuracy level 4) of the
  same weights, converted to a Hugging Face folder by transformers.
The machine's memory bandwidth is measured in the same run (a STREAM-style triad, torch, same threads), and MBU
(bytes of weights read per decode step x steps/s / bandwidth) is reported per engine.

Quality: every engine's perplexity on the same token ids (CPython's LICENSE.txt, strided windows as `runner eval`;
peers scored through their own model files), so a faster quantized engine shows what it costs.

Correctness guard: the first greedy tokens and the perplexity of every fp32 engine must agree (the script fails if not);
each quantized engine's agreement with them is reported. Then ours and onnxruntime-genai's decode runs are profiled per
operator type (runner/tools/profile.py), each in its own process, and where onnxruntime-genai decodes the short prompt
fastest, its decode graph and ours are timed call by call in one process (benchmarks/graph_parity.py), which
tells the graph from the loop around it. Writes benchmarks/results/peers.{json,md,png}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compare_transformers import (  # noqa: E402 (after the sys.path line above)
    contender_ours,
    contender_transformers,
    load_transformers_model,
    write_prompts,
)  # noqa: E402
from benchmarks.graph_parity import parity_markdown  # noqa: E402
from benchmarks.interleave import Generate, decode_rate, interleaved_runs, paired_ratio, serve  # noqa: E402
from benchmarks.provenance import source_commit  # noqa: E402
from runner.core.machine import cpu_model, memory_bandwidth_gbs  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PEER_PACKAGES = {"llama.cpp": "llama-cpp-python", "ort-genai": "onnxruntime-genai"}


def load_llama_cpp(model_path: str, threads: int, logits_all: bool = False):
    """llama.cpp on the GGUF, `threads` threads for prompts and decode; `logits_all` keeps every position's logits."""
    from llama_cpp import Llama

    return Llama(
        model_path=model_path,
        n_ctx=2048,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        verbose=False,
    )


def contender_llama_cpp(model_path: str, threads: int) -> tuple[Generate, dict]:
    import numpy as np
    from llama_cpp import LogitsProcessorList

    start = time.perf_counter()
    llm = load_llama_cpp(model_path, threads)
    load_s = time.perf_counter() - start
    eos = llm.token_eos()

    def no_eos(_ids, scores):
        scores[eos] = -np.inf
        return scores

    def generate(ids: list[int], count: int):
        llm.reset()
        tokens, start, first = [], time.perf_counter(), None
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True, logits_processor=LogitsProcessorList([no_eos])):
            if first is None:
                first = time.perf_counter()
            tokens.append(int(token))
            if len(tokens) == count:
                break
        return first - start, decode_rate(len(tokens), time.perf_counter() - first), tokens

    return generate, {"load_s": load_s, "weight_bytes": model_file_bytes(model_path)}


def ort_genai_generator(model, ids: list[int], count: int):
    """A greedy onnxruntime-genai generator for `count` new tokens after `ids`; min_length = max_length, so EOS
    cannot end the answer early."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + count, min_length=len(ids) + count)
    return og.Generator(model, params)


def contender_ort_genai(model_dir: str, threads: int) -> tuple[Generate, dict]:
    import onnxruntime_genai as og

    start = time.perf_counter()
    model = og.Model(model_dir)
    load_s = time.perf_counter() - start

    def generate(ids: list[int], count: int):
        generator = ort_genai_generator(model, ids, count)
        start = time.perf_counter()
        generator.append_tokens(ids)
        tokens, first = [], None
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            if first is None:
                first = time.perf_counter()
        return first - start, decode_rate(len(tokens), time.perf_counter() - first), tokens

    return generate, {"load_s": load_s, "weight_bytes": model_file_bytes(model_dir)}


def profile_ort_genai(model_dir: str, ids: list[int], threads: int, new_tokens: int):
    """onnxruntime-genai's decode runs per operator type: its model in a scratch folder whose genai_config turns on
    onnxruntime's profiler (the trace is written when the model is released)."""
    import gc
    import tempfile

    import onnxruntime_genai as og

    from runner.tools.profile import SKIPPED_DECODE_RUNS, read_trace

    with tempfile.TemporaryDirectory() as scratch:
        profiled = Path(scratch) / "model"
        profiled.mkdir()
        for source in Path(model_dir).iterdir():
            (profiled / source.name).symlink_to(source.resolve())
        (profiled / "genai_config.json").unlink()
        config = json.loads((Path(model_dir) / "genai_config.json").read_text())
        config["model"]["decoder"]["session_options"]["enable_profiling"] = str(Path(scratch) / "trace")
        (profiled / "genai_config.json").write_text(json.dumps(config))
        model = og.Model(str(profiled))
        generator = ort_genai_generator(model, ids, new_tokens)
        generator.append_tokens(ids)  # the prompt: one run
        while not generator.is_done():
            generator.generate_next_token()
        del generator, model
        gc.collect()
        (trace,) = Path(scratch).glob("trace*.json")
        return read_trace(trace, 1 + SKIPPED_DECODE_RUNS)


def graph_parity_in_own_process(ours: str, peer: str, prompt_tokens: int, threads: int) -> dict:
    """benchmarks/graph_parity.py on our engine and an onnxruntime-genai model, in a process of its own."""
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("graph_parity.py")),
            "--ours",
            ours,
            "--peer",
            peer,
            "--prompt-tokens",
            str(prompt_tokens),
            "--threads",
            str(threads),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    if proc.returncode != 0:
        raise SystemExit(f"graph_parity failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def window_logits_transformers(target: str, threads: int):
    import torch

    model = load_transformers_model(threads)

    def window_logits(ids: list[int]):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].numpy()

    return window_logits


def window_logits_llama_cpp(model_path: str, threads: int):
    import numpy as np

    llm = load_llama_cpp(model_path, threads, logits_all=True)

    def window_logits(ids: list[int]):
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)])

    return window_logits


def window_logits_ort_genai(model_dir: str, threads: int):
    """onnxruntime-genai's model graph run by onnxruntime itself, the whole window as one prompt after an empty
    cache (its generator API gives the last position's logits only): the same graph and weights its generator runs."""
    import numpy as np
    import onnxruntime as ort

    from engines.backends.onnxruntime import session_options

    decoder = json.loads((Path(model_dir) / "genai_config.json").read_text())["model"]["decoder"]
    session = ort.InferenceSession(
        str(Path(model_dir) / decoder["filename"]),
        session_options(ort, threads, spinning=True),
        providers=["CPUExecutionProvider"],
    )
    heads, head_size = decoder["num_key_value_heads"], decoder["head_size"]
    caches = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values")]

    def window_logits(ids: list[int]):
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
        feeds.update({name: np.zeros((1, heads, 0, head_size), np.float32) for name in caches})
        return session.run(["logits"], feeds)[0][0]

    return window_logits


WINDOW_LOGITS = {
    "transformers": window_logits_transformers,
    "llama.cpp": window_logits_llama_cpp,
    "ort-genai": window_logits_ort_genai,
}
PERPLEXITY_WINDOW, PERPLEXITY_STRIDE = 512, 256  # as benchmarks/quantization.py and `runner eval`'s figures in docs/
FP32_PERPLEXITY_TOLERANCE = 0.01  # relative: fp32 engines of the same weights agree far closer (docs/performance.md)


def worker_perplexity(kind: str, target: str, threads: int, text_file: Path) -> dict:
    """Perplexity of one engine on the benchmark text's token ids (ours), the same strided windows for all: ours by
    `runner eval`'s code, a peer through the same windows of its own logits."""
    from runner.core.args import EngineArgs
    from runner.core.engine import LLMEngine
    from runner.tools.evaluate import perplexity, strided_perplexity

    ids = json.loads(text_file.read_text())
    if kind == "ours":
        result = perplexity(
            LLMEngine(EngineArgs(target, threads=threads, max_batch=1)), ids, PERPLEXITY_WINDOW, PERPLEXITY_STRIDE
        )
    else:
        result = strided_perplexity(ids, PERPLEXITY_WINDOW, PERPLEXITY_STRIDE, WINDOW_LOGITS[kind](target, threads))
    return {"perplexity": result.perplexity, "tokens_scored": result.tokens_scored}


def worker_profile(kind: str, target: str, threads: int, new_tokens: int, prompts_file: Path) -> dict:
    from dataclasses import asdict

    from runner.tools.profile import profile_decode

    ids = json.loads(prompts_file.read_text())["short"]
    if kind == "ours":
        return asdict(profile_decode(target, ids, new_tokens, threads, max_batch=1))  # as timed (contender_ours)
    return asdict(profile_ort_genai(target, ids, threads, new_tokens))


CONTENDERS = {
    "ours": contender_ours,
    "transformers": contender_transformers,
    "llama.cpp": contender_llama_cpp,
    "ort-genai": contender_ort_genai,
}


def ensure_package(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        click.echo(f"installing {distribution} (for this benchmark only, not a project dependency)", err=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", distribution], check=True)
        return version(distribution)


def ort_genai_models(work: Path, threads: int) -> dict[str, Path]:
    """onnxruntime-genai's own CPU models of the default model: the GGUF -> a Hugging Face folder (transformers)
    -> its model builder, fp32 and int4; the session's thread count set in each genai_config.json."""
    import torch
    import transformers

    from builder.loaders.default import default_gguf_path

    hf = work / "hf"
    if not (hf / "config.json").is_file():
        path = default_gguf_path()
        from safetensors.torch import save_file

        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        # transformers refuses save_pretrained for a GGUF-loaded model: write the folder's two files ourselves
        hf.mkdir(parents=True, exist_ok=True)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        (hf / "config.json").write_text(json.dumps(config, indent=2))
        tied = model.config.tie_word_embeddings
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
        transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(hf)
    return {
        precision: ort_genai_model(hf, work / f"ort-genai-{precision}", precision, work, threads)
        for precision in ("fp32", "int4")
    }


def ort_genai_model(hf: Path, out: Path, precision: str, work: Path, threads: int) -> Path:
    """onnxruntime-genai's model builder's CPU model of the checkpoint `hf` in `out` (made once; int4: RTN blocks of
    32, accuracy level 4), its session set to `threads` threads in genai_config.json."""
    if not (out / "genai_config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out)]
            + ["-p", precision, "-e", "cpu", "-c", str(work / "cache"), "--extra_options", "int4_accuracy_level=4"],
            check=True,
            capture_output=True,
            text=True,
        )
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    config_path.write_text(json.dumps(config, indent=4))
    return out


def write_perplexity_text(engine: str, path: Path) -> None:
    """CPython's LICENSE.txt as our engine's tokenizer encodes it (real prose nobody here wrote; `runner eval` and
    benchmarks/quantization.py use it too): every engine is scored on these ids."""
    from runner.core.args import EngineArgs
    from runner.core.engine import LLMEngine
    from runner.tools.bench import license_text

    path.write_text(json.dumps(LLMEngine(EngineArgs(engine, verify_checksums=False)).codec.encode(license_text())))


def engine_label(engine: Path) -> str:
    manifest = json.loads((engine / "manifest.json").read_text())
    q = manifest["quantization"]
    ops = manifest["graphs"][manifest["phases"]["decode"]["graph"]]["native_ops"]  # our kernels the engine runs
    variants = []
    if manifest["kv_cache"]["dtype"] == "int8":
        variants.append("int8 KV cache")
    elif "DecodeAttention" not in ops:  # onnxruntime's attention where ours could be
        variants.append("onnxruntime attention")
    if q["bits"] == 4 and "Int4MatMul" not in ops:
        variants.append("onnxruntime matmul")
    variant = "".join(f", {v}" for v in variants)
    if q["method"] == "none":
        return f"ours {manifest['dtype']}{variant}"
    return f"ours int{q['bits']} {q['method']} g{q['group_size']}{variant}"


def check_agreement(results: dict[str, dict], reference: str) -> list[str]:
    """Mark each engine's "agreement": whether its first greedy tokens on both prompts are `reference`'s (our fp32
    engine's). Returns the fp32 engines that disagree with it on those tokens or on perplexity beyond
    FP32_PERPLEXITY_TOLERANCE: the same weights in fp32 must decode and score alike, which guards every engine's
    harness (quantized engines' differences are only reported)."""
    expected = results[reference]
    disagreeing = []
    for label, r in results.items():
        same = {p: r[p]["first_tokens"] == expected[p]["first_tokens"] for p in ("short", "long")}
        r["agreement"] = (
            "yes" if all(same.values()) else "no (" + ", ".join(p for p, ok in same.items() if not ok) + ")"
        )
        scored_alike = abs(r["perplexity"] / expected["perplexity"] - 1) <= FP32_PERPLEXITY_TOLERANCE
        if "fp32" in label and not (all(same.values()) and scored_alike):
            disagreeing.append(label)
    return disagreeing


def standing(engines: dict[str, dict]) -> list[dict]:
    """For each prompt, our best engine against the best peer (by their medians) in decode tokens/s and TTFT, as
    paired ratios over the rounds, > 1 meaning ours is ahead."""
    ours_labels = [label for label in engines if label.startswith("ours")]
    peer_labels = [label for label in engines if not label.startswith("ours")]
    rows = []
    for prompt in ("short", "long"):
        for metric in ("decode_tok_s", "ttft_ms"):
            best = max if metric == "decode_tok_s" else min
            ours = best(ours_labels, key=lambda label: engines[label][prompt][metric])
            peer = best(peer_labels, key=lambda label: engines[label][prompt][metric])
            ours_runs, peer_runs = engines[ours][prompt][f"{metric}_runs"], engines[peer][prompt][f"{metric}_runs"]
            if metric == "decode_tok_s":
                median, low, high = paired_ratio(ours_runs, peer_runs)
            else:  # a shorter time is better
                median, low, high = paired_ratio(peer_runs, ours_runs)
            rows.append(
                {
                    "prompt": prompt,
                    "metric": metric,
                    "ours": ours,
                    "peer": peer,
                    "ours_ahead_by": median,
                    "lowest": low,
                    "highest": high,
                    "rounds": len(ours_runs),
                }
            )
    return rows


def standing_markdown(rows: list[dict]) -> list[str]:
    names = {"decode_tok_s": "decode", "ttft_ms": "TTFT"}
    lines = [
        "| prompt | metric | our best | best peer | ours ahead by (median of paired rounds) | range over rounds |",
        "|---|---|---|---|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt']} | {names[r['metric']]} | {r['ours']} | {r['peer']} | {r['ours_ahead_by']:.2f}x "
            f"| {r['lowest']:.2f}-{r['highest']:.2f}x ({r['rounds']} rounds) |"
        )
    return lines


def model_file_bytes(target: str) -> int:
    """A peer's weight bytes per decode step: its model files (llama.cpp's GGUF; ort-genai's int4 LM head also
    serves its embedding lookups, so nothing there is read only a row at a time)."""
    path = Path(target)
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.suffix in (".onnx", ".data")]
    return sum(p.stat().st_size for p in files)


def markdown(report: dict) -> list[str]:
    lines = [
        f"Default model, {report['machine']}, memory bandwidth {report['bandwidth_gbs']:.1f} GB/s (triad), commit "
        f"{report['commit']}; batch 1, greedy, {report['new_tokens']} new tokens (EOS suppressed), median of "
        f"{report['runs']} after a warm-up, runs interleaved across engines.",
        "",
        "| engine | TTFT short ms | TTFT long ms | decode short tok/s | decode long tok/s | MiB read per token | MBU "
        "short "
        "| peak RSS MiB | first 16 tokens = fp32 | perplexity |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for label, r in report["engines"].items():
        lines.append(
            f"| {label} | {r['short']['ttft_ms']:.0f} | {r['long']['ttft_ms']:.0f} | {r['short']['decode_tok_s']:.1f} "
            f"| {r['long']['decode_tok_s']:.1f} | {r['weight_bytes'] / 2**20:.0f} | {r['mbu_short']:.0%} "
            f"| {r['peak_rss_mb']:.0f} | {r['agreement']} | {r['perplexity']:.3f} |"
        )
    lines += [
        "",
        f"Perplexity: CPython's LICENSE.txt ({report['perplexity_tokens']} tokens scored), windows of "
        f"{PERPLEXITY_WINDOW} every {PERPLEXITY_STRIDE} tokens, the same token ids for every engine (lower is better).",
    ]
    return lines


def profile_markdown(profiles: dict[str, dict], top: int = 8) -> list[str]:
    """One table: for each profiled engine, ms per decode run (profiler on) and nodes per run of its top op types."""
    lines = [
        "| engine | per run, profiler on | between kernels | " + " | ".join(f"op {i + 1}" for i in range(top)) + " |",
        "|---|---:|---:|" + "---|" * top,
    ]
    for label, p in profiles.items():
        cells = [f"{op['op']} {op['ms_per_run']:.2f} ms ({op['nodes_per_run']:.0f})" for op in p["ops"][:top]]
        cells += [""] * (top - len(cells))
        lines.append(
            f"| {label} | {p['run_ms']:.2f} ms | {p['run_ms'] - p['kernel_ms']:.2f} ms | " + " | ".join(cells) + " |"
        )
    return lines


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(report["engines"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(labels) + 2))
    for axis, metric, title in (
        (axes[0], "decode_tok_s", "decode tokens/s (higher is better)"),
        (axes[1], "ttft_ms", "time to first token, ms (lower is better)"),
    ):
        for offset, prompt in ((-0.2, "short"), (0.2, "long")):
            values = [report["engines"][label][prompt][metric] for label in labels]
            axis.barh([i + offset for i in range(len(labels))], values, height=0.4, label=f"{prompt} prompt")
        axis.set_yticks(range(len(labels)), labels)
        axis.invert_yaxis()
        axis.set_title(title)
        axis.legend()
    fig.suptitle(f"default model, {report['machine']}, commit {report['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


@click.command()
@click.option(
    "--ours",
    "ours",
    multiple=True,
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="Our engine(s) of the default model; the first must be fp32 (its tokenizer gives every engine's ids).",
)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--runs", type=int, default=5, show_default=True)
@click.option("--peers", default="transformers,llama.cpp,ort-genai", show_default=True)
@click.option("--work", type=click.Path(path_type=Path), default=ROOT / "engines-out" / "peers", show_default=True)
@click.option("--worker-kind", default=None, hidden=True)
@click.option("--worker-target", default=None, hidden=True)
def main(ours, threads, new_tokens, runs, peers, work, worker_kind, worker_target) -> None:
    prompts_file, text_file = work / "prompts.json", work / "perplexity_text.json"
    if worker_kind and worker_kind.startswith("perplexity:"):
        print(json.dumps(worker_perplexity(worker_kind.removeprefix("perplexity:"), worker_target, threads, text_file)))
        return
    if worker_kind and worker_kind.startswith("profile:"):
        print(
            json.dumps(
                worker_profile(worker_kind.removeprefix("profile:"), worker_target, threads, new_tokens, prompts_file)
            )
        )
        return
    if worker_kind:
        generate, info = CONTENDERS[worker_kind](worker_target, threads)
        serve(generate, info, json.loads(prompts_file.read_text()), new_tokens)
        return
    from builder.loaders.default import default_gguf_path

    if engine_label(ours[0]) != "ours fp32":  # the reference every engine's first greedy tokens are checked against
        raise click.BadParameter(
            f"the first --ours must be an fp32 engine, not {engine_label(ours[0])}", param_hint="--ours"
        )
    prompts = write_prompts(str(ours[0]), prompts_file)
    write_perplexity_text(str(ours[0]), text_file)
    engines = [(engine_label(e), "ours", str(e)) for e in ours]
    wanted = [p.strip() for p in peers.split(",") if p.strip()]
    versions = {name: version(name) for name in ("onnxruntime", "torch", "transformers")}
    ensure_package("matplotlib")  # the chart is drawn last: install it before the run, not after
    for peer in wanted:
        if peer in PEER_PACKAGES:
            versions[PEER_PACKAGES[peer]] = ensure_package(PEER_PACKAGES[peer])
    if "transformers" in wanted:
        engines.append(("transformers fp32 eager", "transformers", str(ours[0])))
    if "llama.cpp" in wanted:
        engines.append(("llama.cpp Q4_1 (the GGUF)", "llama.cpp", str(default_gguf_path())))
    if "ort-genai" in wanted:
        for precision, model_dir in ort_genai_models(work, threads).items():
            engines.append((f"ort-genai {precision}", "ort-genai", str(model_dir)))

    def worker_argv(kind: str, target: str) -> list[str]:
        return [
            sys.executable,
            __file__,
            "--ours",
            str(ours[0]),
            "--threads",
            str(threads),
            "--new-tokens",
            str(new_tokens),
            "--work",
            str(work),
            "--worker-kind",
            kind,
            "--worker-target",
            target,
        ]

    def in_own_process(label: str, kind: str, target: str) -> dict:
        click.echo(f"{label}: {kind}", err=True)
        proc = subprocess.run(
            worker_argv(kind, target),
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        )
        if proc.returncode != 0:
            raise SystemExit(f"{label} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    bandwidth = memory_bandwidth_gbs(threads)
    workers = {label: worker_argv(kind, target) for label, kind, target in engines}
    results = interleaved_runs(workers, prompts, runs, threads, log=lambda line: click.echo(line, err=True))
    for r in results.values():
        r["mbu_short"] = r["weight_bytes"] * r["short"]["decode_tok_s"] / (bandwidth * 1e9)
    # after the timed runs, in their own processes: the profiler slows every node down
    profiles = {
        label: in_own_process(label, f"profile:{kind}", target)
        for label, kind, target in engines
        if kind in ("ours", "ort-genai")
    }
    for label, kind, target in engines:
        results[label].update(in_own_process(label, f"perplexity:{kind}", target))
    report_standing = standing(results)
    # where the best short-prompt decoder is onnxruntime-genai's, its graph and ours alone, call by call
    targets = {label: target for label, _, target in engines}
    graphs = [
        {
            "ours": r["ours"],
            "peer": r["peer"],
            **graph_parity_in_own_process(targets[r["ours"]], targets[r["peer"]], len(prompts["short"]), threads),
        }
        for r in report_standing
        if r["prompt"] == "short" and r["metric"] == "decode_tok_s" and r["peer"].startswith("ort-genai")
    ]

    reference = results[engine_label(ours[0])]
    disagreeing = check_agreement(results, engine_label(ours[0]))
    commit = source_commit()
    report = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {threads} threads",
        "bandwidth_gbs": bandwidth,
        "commit": commit,
        "versions": versions,
        "new_tokens": new_tokens,
        "runs": runs,
        "engines": results,
        "profiles": profiles,
        "standing": report_standing,
        "graph_parity": graphs,
        "perplexity_tokens": reference["tokens_scored"],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "peers.json").write_text(json.dumps(report, indent=2))
    lines = markdown(report)
    lines += [
        "",
        "Our best engine against the best peer, per round (each round runs every engine once, one after the other, "
        "so a ratio compares runs seconds apart; > 1: ours ahead):",
        "",
    ]
    lines += standing_markdown(report["standing"])
    for g in graphs:
        lines += ["", parity_markdown(g["ours"], g["peer"], g)]
    lines += ["", "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items())]
    lines += [
        "",
        "Where a batch-1 decode run of the short prompt spends its time, per operator type (onnxruntime's "
        "profiler, which adds a few microseconds per node: times are inflated, most for graphs with many nodes; "
        "in brackets the nodes per run):",
        "",
    ]
    lines += profile_markdown(profiles)
    (RESULTS / "peers.md").write_text("\n".join(lines) + "\n")
    chart(report, RESULTS / "peers.png")
    click.echo("\n".join(lines))
    if disagreeing:
        raise SystemExit(
            f"fp32 engines disagree with ours fp32 (first greedy tokens or perplexity): {', '.join(disagreeing)}"
        )


if __name__ == "__main__":
    main()
