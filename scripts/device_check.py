"""The GPU check, run on a lent GPU machine by scripts/device_check.sh (nothing but that machine's image: torch,
Triton, transformers, onnxruntime for the side graphs). Each stage records its result or its error and the next
one runs anyway; everything lands in $OUT/device_check.json and a short table in $OUT/device_check.md.

1. the Triton kernel's tests on CUDA (tests/plugins/test_blockwise_matmul.py, bf16 included), and its speed
   against a bf16 matmul on the 1B shape's linears at 1, 8 and 1,000 rows;
2. a tiny random checkpoint built with --backend aoti --device cuda (fp32, and int4 through the Triton kernel):
   greedy tokens against transformers on the same weights;
3. a random-weight Llama of 1B shape (hidden 2048, 16 layers, 32 / 8 heads, intermediate 8192, vocab 128256)
   built bf16 and int4: decode tokens/s at batch 1 and 8, the prefill of a 1,000-token prompt (TTFT before
   sampling), decode MBU;
4. the same weights under a gpt-fast-style torch.compile static-cache loop (benchmarks/gpt_fast_baseline.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = Path(os.environ.get("OUT", "device_check_out"))
ONE_B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    architectures=["LlamaForCausalLM"],
    model_type="llama",
)
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s, SXM parts
PROMPT, NEW_TOKENS = 1000, 128
# The check ends by itself before the device call's limit: a stage that would start past this is recorded as skipped.
DEADLINE = time.monotonic() + float(os.environ.get("DEVICE_CHECK_SECONDS", "470"))


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds_left() -> float:
    return DEADLINE - time.monotonic()


def stage(results: dict, name: str, run, needs: float = 0.0) -> None:
    """Runs one stage unless fewer than `needs` seconds are left before the deadline."""
    if seconds_left() < needs:
        results[name] = {"skipped": f"{seconds_left():.0f} s left, the stage needs about {needs:.0f}"}
        print(f"== {name}: skipped", flush=True)
        return
    start = time.perf_counter()
    try:
        results[name] = run()
    except Exception:  # a stage's failure is a result too; the others still run
        results[name] = {"error": traceback.format_exc(limit=8)}
    results[name] = {**results[name], "seconds": round(time.perf_counter() - start, 1)}
    print(f"== {name}: {json.dumps(results[name])[:2000]}", flush=True)
    if OUT.is_dir():  # after every stage, so a run cut short by its time limit keeps what it measured
        (OUT / "device_check.json").write_text(json.dumps(results, indent=2))


def kernel_tests() -> dict:
    import importlib.util

    workers = ["-n", "4"] if importlib.util.find_spec("xdist") else []  # the kernels' compiles are CPU work
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *workers,
            "tests/plugins/test_blockwise_matmul.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return {"returncode": run.returncode, "tail": run.stdout[-1500:]}


def kernel_speed() -> dict:
    """The Triton kernel against a bf16 cuBLAS matmul on the 1B shape's linears (random codes, groups of 32):
    microseconds per call and the weight bytes it streams per second, for a decode row, a decode batch and a
    prompt chunk."""
    import triton.testing

    from plugins.blockwise_matmul import Tile, _launch, run_kernel, tile_index

    results = {}
    decode_tiles = [Tile(16, columns, warps) for columns in (16, 32, 64, 128) for warps in (2, 4)]
    c = ONE_B
    kv = c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    shapes = {"qkv": (c["hidden_size"] + 2 * kv, c["hidden_size"]), "o": (c["hidden_size"], c["hidden_size"])}
    shapes |= {
        "gate_up": (2 * c["intermediate_size"], c["hidden_size"]),
        "down": (c["hidden_size"], c["intermediate_size"]),
    }
    for name, (n, k) in shapes.items():
        qweight = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, device="cuda")
        scales = torch.rand(n * k // 32, device="cuda") / 100
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for rows in (1, 8, 1000):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            tile = tile_index(rows)
            int4_ms = triton.testing.do_bench(partial(run_kernel, x, qweight, scales, None, k, n, 4, 32, tile))
            bf16_ms = triton.testing.do_bench(partial(torch.matmul, x, weight.t()))
            results[f"{name}_m{rows}"] = {
                "int4_us": round(int4_ms * 1e3, 1),
                "bf16_us": round(bf16_ms * 1e3, 1),
                "int4_weight_gb_s": round((n * k / 2 + n * k / 32 * 4) / int4_ms / 1e6, 1),
            }
            if rows <= 8:  # other decode tiles, to choose the shipped one from
                results[f"{name}_m{rows}_tiles_us"] = {
                    f"{t.block_m}x{t.block_n}w{t.num_warps}": round(
                        triton.testing.do_bench(partial(_launch, x, qweight, scales, None, k, n, 4, 32, t)) * 1e3, 1
                    )
                    for t in decode_tiles
                }
    return results


def build(source: Path, out: Path, device: str = "cuda", **options) -> Path:
    from builder.build import BuildOptions, build_engine

    build_engine(BuildOptions(str(source), out, backend="aoti", device=device, overwrite=True, **options), log=print)
    return out


def tiny_parity(work: Path, device: str = "cuda", quants: tuple[str, ...] = ("none", "int4")) -> dict:
    from runner import LLM, SamplingParams
    from tests.reference import load_reference, reference_greedy
    from tests.tiny_checkpoint import make_checkpoint

    checkpoint = work / "tiny" if (work / "tiny").is_dir() else make_checkpoint(work / "tiny")
    reference = load_reference(checkpoint)
    results = {}
    for quant in quants:
        engine = work / f"tiny-{quant}"
        if not (engine / "manifest.json").is_file():  # a second try (without CUDA graphs) runs the same engine
            build(checkpoint, engine, device, quant=quant, max_seq_len=256, max_batch=4)
        llm = LLM(engine)
        prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        ours = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
        if quant == "none":
            results["fp32_greedy_identical_to_transformers"] = ours == reference_greedy(reference, prompt, 32)
        else:
            results["int4_tokens"] = ours[:8]
        results["cuda_graph_error"] = getattr(llm.engine.executor.backend, "cuda_graph_error", None)
    return results


def one_b_checkpoint(work: Path) -> Path:
    from safetensors.torch import save_file

    from tests.tiny_checkpoint import make_tokenizer

    directory = work / "llama-1b-random"
    directory.mkdir(parents=True, exist_ok=True)
    c = ONE_B
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    shapes = {
        "model.embed_tokens.weight": (c["vocab_size"], c["hidden_size"]),
        "model.norm.weight": (c["hidden_size"],),
    }
    shapes["lm_head.weight"] = (c["vocab_size"], c["hidden_size"])
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c["hidden_size"],),
            p + "post_attention_layernorm.weight": (c["hidden_size"],),
            p + "self_attn.q_proj.weight": (c["hidden_size"], c["hidden_size"]),
            p + "self_attn.k_proj.weight": (c["num_key_value_heads"] * head_dim, c["hidden_size"]),
            p + "self_attn.v_proj.weight": (c["num_key_value_heads"] * head_dim, c["hidden_size"]),
            p + "self_attn.o_proj.weight": (c["hidden_size"], c["hidden_size"]),
            p + "mlp.gate_proj.weight": (c["intermediate_size"], c["hidden_size"]),
            p + "mlp.up_proj.weight": (c["intermediate_size"], c["hidden_size"]),
            p + "mlp.down_proj.weight": (c["hidden_size"], c["intermediate_size"]),
        }
    generator = torch.Generator("cuda").manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, device="cuda", generator=generator) * 0.02).to(torch.bfloat16).cpu()
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({**c, "torch_dtype": "bfloat16"}))
    make_tokenizer(320).save(str(directory / "tokenizer.json"))
    return directory


def time_engine(engine: Path, weight_bytes: int, prompt_len: int = PROMPT, new_tokens: int = NEW_TOKENS) -> dict:
    """Prefill of a `prompt_len`-token prompt, then greedy decode at batch 1 and 8 through the runner's executor
    (its greedy loop: the graph calls and the host work between them)."""
    from engines.format import open_artifact
    from runner.core.args import EngineArgs
    from runner.core.engine import LLMEngine

    executor = LLMEngine(EngineArgs(engine)).executor
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 300, prompt_len).tolist()
    executor.prefill(0, prompt, 0)  # warm-up
    synchronize()
    start = time.perf_counter()
    executor.prefill(0, prompt, 0)
    ttft = time.perf_counter() - start
    # one prompt chunk through the step graph: the TTFT before sampling
    results = {f"prefill_{prompt_len}_s": round(ttft, 4)}
    no_stop = np.zeros(open_artifact(engine, verify_checksums=False).manifest.model.vocab_size, bool)
    for batch in (1, min(8, executor.max_rows)):
        rows = list(range(batch))
        short = prompt[:32]  # each row holds a short prompt, then decodes after it
        for row in rows:
            executor.prefill(row, short, 0)
        executor.decode_greedy(rows, [5] * batch, [len(short)] * batch, 8, no_stop)  # warm-up: CUDA graph capture
        synchronize()
        start = time.perf_counter()
        executor.decode_greedy(rows, [5] * batch, [len(short) + 8] * batch, new_tokens, no_stop)
        seconds = time.perf_counter() - start
        results[f"decode_b{batch}_tok_s"] = round(batch * new_tokens / seconds, 1)
        if batch == 1:
            name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            peak = next((v for k, v in PEAK_BANDWIDTH.items() if k in name), None)
            achieved = weight_bytes * new_tokens / seconds
            results["decode_b1_weight_gb_per_s"] = round(achieved / 1e9, 1)
            results["decode_b1_mbu"] = None if peak is None else round(achieved / peak, 3)
    results["cuda_graph_error"] = getattr(executor.backend, "cuda_graph_error", None)
    return results


def start_build(checkpoint: Path, out: Path, device: str = "cuda", **flags) -> tuple[subprocess.Popen, Path, float]:
    """`builder build --backend aoti --device cuda` in a process of its own, so that the 1B engines compile (CPU
    work) while the other stages run; returns the process, the engine's directory (its log beside it, .log) and the
    start time."""
    args = [sys.executable, "-m", "training.cli", "build", str(checkpoint), "--out", str(out), "--overwrite"]
    args += ["--backend", "aoti", "--device", device]
    for name, value in flags.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    with out.with_suffix(".log").open("w") as stream:
        process = subprocess.Popen(args, cwd=ROOT, stdout=stream, stderr=subprocess.STDOUT)
    return process, out, time.perf_counter()


def finish_build(build: tuple[subprocess.Popen, Path, float]) -> tuple[Path, float]:
    """Waits for a build from `start_build` (no longer than the deadline allows): the engine and its build time."""
    process, out, started = build
    log = out.with_suffix(".log")
    try:
        process.wait(timeout=max(seconds_left(), 1))
    except subprocess.TimeoutExpired:
        process.kill()
        tail = log.read_text()[-1500:]
        raise RuntimeError(f"the build was still running at the deadline; its log ends:\n{tail}") from None
    if process.returncode != 0:
        raise RuntimeError(f"the build failed ({process.returncode}); its log ends:\n{log.read_text()[-3000:]}")
    return out, round(time.perf_counter() - started, 1)


def one_b_weight_bytes() -> dict[str, int]:
    """Bytes one decode step streams from the linears and LM head: bf16, and int4 (half a byte per weight plus an
    fp32 scale per 32)."""
    c = ONE_B
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    linear = (
        c["num_hidden_layers"]
        * (
            2 * c["hidden_size"] ** 2
            + 2 * c["num_key_value_heads"] * head_dim * c["hidden_size"]
            + 3 * c["hidden_size"] * c["intermediate_size"]
        )
        + c["vocab_size"] * c["hidden_size"]
    )
    return {"bf16": 2 * linear, "int4": linear // 2 + linear // 32 * 4}


ONE_B_ENGINES = {"bf16": dict(dtype="bf16"), "int4": dict(dtype="bf16", quant="int4")}
ONE_B_SHAPES = dict(max_seq_len=PROMPT + NEW_TOKENS + 64, max_batch=8, prefill_chunk=1024)


def start_one_b(work: Path, started: dict) -> dict:
    """Writes the 1B checkpoint and starts both its builds, into `started` for `time_one_b`."""
    checkpoint = one_b_checkpoint(work)
    builds = {
        name: start_build(checkpoint, work / f"1b-{name}", **flags, **ONE_B_SHAPES)
        for name, flags in ONE_B_ENGINES.items()
    }
    started.update(checkpoint=checkpoint, builds=builds)
    return {"building": sorted(builds)}


def time_one_b(started: dict, results: dict, eager: bool = False) -> None:
    """Once both 1B builds are done (nothing else compiling, so the timings are clean): each engine's prefill and
    decode (`eager`: without CUDA graphs), then the gpt-fast-style loop on the same weights."""
    engines = {}
    for name in ONE_B_ENGINES:
        try:
            engines[name] = finish_build(started["builds"][name])
        except Exception as error:
            engines[name] = error
    weight_bytes = one_b_weight_bytes()
    for name, engine in engines.items():

        def timed(engine=engine, name=name):
            if isinstance(engine, Exception):
                raise engine
            path, build_seconds = engine
            timing = isolated("time", str(path), str(weight_bytes[name]), eager=eager)
            return {"build_s": build_seconds, "eager": eager, **timing}

        stage(results, f"1b_{name}", timed, needs=30)
    stage(results, "1b_gpt_fast_style", lambda: isolated("gpt_fast", str(started["checkpoint"])), needs=60)


def isolated(name: str, *args: str, eager: bool = False) -> dict:
    """A stage in a process of its own (`python scripts/device_check.py --one NAME ARGS...`), so that a crash in
    compiled code (a segfault) is a result with its Python traceback (faulthandler), not the end of the check.
    `eager`: without CUDA graphs."""
    result = Path(tempfile.mkdtemp()) / "result.json"
    command = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--one", name, str(result), *args]
    env = os.environ | ({"DEVICE_CHECK_EAGER": "1"} if eager else {})
    try:
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=max(seconds_left(), 1))
    except subprocess.TimeoutExpired:
        return {"error": "still running at the deadline"}
    keep_log(name, run.stdout + run.stderr)
    if run.returncode != 0 or not result.is_file():
        return {"error": f"exit {run.returncode}", "log_tail": crash_excerpt(run.stdout + run.stderr)}
    return json.loads(result.read_text())


def keep_log(name: str, log: str) -> None:
    """Every isolated process's whole output (up to 30,000 characters each) goes to $OUT/stage_logs.txt."""
    if OUT.is_dir():
        with (OUT / "stage_logs.txt").open("a") as stream:
            stream.write(f"\n===== {name} =====\n{log[-30000:]}\n")


def crash_excerpt(log: str, size: int = 3000) -> str:
    """What says why a process died: its faulthandler traceback (without the long list of extension modules that
    follows it) and the lines before it, where a C++ exception is printed; else the log's end."""
    fatal = log.find("Fatal Python error")
    if fatal < 0:
        return log[-size:]
    end = log.find("Extension modules:", fatal)
    return log[max(0, fatal - size // 2) : fatal] + log[fatal : end if end > 0 else None][: size // 2]


# A one-Linear model through export, AOTInductor and the package loader, in a process that imports nothing of this
# repository: whether the machine's torch and C++ compiler make packages that load at all. Each step prints a line
# first, so a crash says which step it was; `runner` loads the compiled library with the container runner instead of
# the package loader (torch._export.aot_load), which tells a loader fault from one in the compiled code.
AOTI_SMOKE = """
import json, os, sys, tempfile, zipfile, torch
device, loader = sys.argv[1], sys.argv[2]
model = torch.nn.Linear(8, 4).to(device)
x = torch.randn(3, 8, device=device)
program = torch.export.export(model, (x,))
print("exported", flush=True)
if loader == "runner":
    library = torch._inductor.aot_compile(program.module(), (x,))
    print("compiled", library, flush=True)
    os.system("ldd " + library)
    loaded = torch._export.aot_load(library, device)
else:
    path = torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(tempfile.mkdtemp(), "m.pt2"))
    print("compiled", zipfile.ZipFile(path).namelist(), flush=True)
    loaded = torch._inductor.aoti_load_package(path)
print("loaded", flush=True)
torch.testing.assert_close(loaded(x), model(x))
print(json.dumps({"ok": True}))
"""


def machine_facts() -> dict:
    """What a loader crash may depend on: the C++ ABI and compiler torch was built with, the libstdc++ this process
    loaded, the OS, TMPDIR."""
    import platform

    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    libstdcxx = sorted({line.split()[-1] for line in maps.splitlines() if "libstdc++" in line})
    config = torch.__config__.show().splitlines()
    os_release = Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else ""
    return {
        "cxx11_abi": torch.compiled_with_cxx11_abi(),
        "torch_built_with": re.findall(r"CXX_COMPILER=([^,]*)", "\n".join(config))
        + [line.strip() for line in config if "GCC" in line][:1],
        "libstdcxx_loaded": libstdcxx,
        "os": next((line for line in os_release.splitlines() if line.startswith("PRETTY_NAME")), platform.platform()),
        "python": sys.version.split()[0],
        "TMPDIR": os.environ.get("TMPDIR"),
    }


def aoti_smoke() -> dict:
    """The AOTI smoke model through the package loader on CPU and CUDA with each C++ compiler the machine has (CXX),
    on CPU with a fresh TMPDIR and through the container runner, and once under gdb for a native backtrace, all
    side by side. `working_env`: the first CUDA variant that loaded (its environment is then used for the rest of
    the check), or None."""
    import shutil

    compilers = [name for name in ("g++", "clang++") if shutil.which(name)]
    results = {
        name: subprocess.run([name, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        for name in compilers
    }
    results["facts"] = machine_facts()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    variants = {
        f"{device}_{compiler}": (device, "package", {"CXX": compiler}) for device in devices for compiler in compilers
    }
    for device in devices:
        variants[f"{device}_fresh_tmpdir"] = (device, "package", {"TMPDIR": tempfile.mkdtemp()})
        variants[f"{device}_runner"] = (device, "runner", {})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    smoke = [sys.executable, "-X", "faulthandler", "-c", AOTI_SMOKE]
    gdb = ["gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 40", "--args"] if shutil.which("gdb") else None

    def start(command, overrides):
        return subprocess.Popen(
            command,
            cwd=tempfile.mkdtemp(),
            env=env | overrides,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    runs = {name: start(smoke + [device, loader], overrides) for name, (device, loader, overrides) in variants.items()}
    if gdb:
        runs["cpu_under_gdb"] = start(gdb + smoke + ["cpu", "package"], {})
    working = None
    for name, process in runs.items():
        try:
            log = process.communicate(timeout=max(seconds_left() - 60, 1))[0]
        except subprocess.TimeoutExpired:
            process.kill()
            log = process.communicate()[0] + "\n(killed: still running)"
        keep_log(f"aoti_smoke_{name}", log)
        passed = process.returncode == 0 and '"ok": true' in log
        if name == "cpu_under_gdb":  # the signal and the native backtrace after it
            signal = log.find("received signal")
            results[name] = (
                log[max(signal - 300, 0) : signal + 4000] if signal >= 0 else ("ok" if passed else log[-2000:])
            )
            continue
        results[name] = "ok" if passed else {"exit": process.returncode, "log_tail": crash_excerpt(log, 1500)}
        device, loader, overrides = variants[name]
        if passed and device == "cuda" and loader == "package" and working is None:
            working = overrides
    results["working_env"] = working
    return results


def run_one(name: str, result: Path, args: list[str]) -> None:
    """The body of an `isolated` stage."""
    if os.environ.get("DEVICE_CHECK_EAGER") == "1":  # the runner's AOTInductor backend without CUDA graphs
        from engines.backends import aoti

        aoti.AOTInductorBackend.__init__.__defaults__ = (None, None, False)
    if name == "tiny":
        value = tiny_parity(Path(args[0]), "cuda" if torch.cuda.is_available() else "cpu", tuple(args[1:]))
    elif name == "time":
        value = time_engine(Path(args[0]), int(args[1]))
    elif name == "gpt_fast":
        from benchmarks.gpt_fast_baseline import time_decode

        prompt = np.random.default_rng(0).integers(3, 300, PROMPT).tolist()
        runs = {f"b{b}": time_decode(Path(args[0]), prompt, b, NEW_TOKENS) for b in (1, 8)}
        value = {batch: {k: v for k, v in run.items() if k != "tokens"} for batch, run in runs.items()}
    else:
        value = kernel_speed()
    result.write_text(json.dumps(value))


def table(results: dict) -> str:
    lines = ["| stage | result |", "| --- | --- |"]
    lines += [f"| {name} | {json.dumps(value)[:400]} |" for name, value in results.items()]
    return "\n".join(lines) + "\n"


STAGES = ("kernel", "tiny", "1b")


def main() -> None:
    """`python scripts/device_check.py [STAGE...]`: all stages, or those named (to split the check over two calls)."""
    if sys.argv[1:2] == ["--one"]:
        return run_one(sys.argv[2], Path(sys.argv[3]), sys.argv[4:])
    stages = sys.argv[1:] or list(STAGES)
    if unknown := set(stages) - set(STAGES):
        raise SystemExit(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}")
    OUT.mkdir(parents=True, exist_ok=True)
    results = {
        "machine": {
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__,
            # the device machine gets a copy of the working tree without its history: the caller names the commit
            "commit": os.environ.get("DEVICE_CHECK_COMMIT")
            or subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        }
    }
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        # The order saves device time: the 1B engines compile in the background while the tiny engines and the
        # kernel's tests run; every timing comes after all compiling is done.
        started = {}
        stage(results, "aoti_smoke", aoti_smoke, needs=30)
        loads = results["aoti_smoke"].get("working_env")
        if loads is not None:
            os.environ.update(loads)  # the compiler (or TMPDIR) with which a package loaded, for every later stage
        elif torch.cuda.is_available():
            # no package loads on this machine: the stages that run one would only crash again
            stages = [name for name in stages if name == "kernel"]
            results["aoti_stages"] = {"skipped": "no AOTInductor package loads here (see aoti_smoke)"}
        if "1b" in stages:
            stage(results, "1b_checkpoint_and_builds_started", lambda: start_one_b(work, started))
        eager = False
        if "tiny" in stages:
            # fp32 only here: the int4 kernel is checked by its tests and runs in the 1B int4 engine
            stage(results, "tiny_parity", lambda: isolated("tiny", str(work), "none"), needs=30)
            if "error" in results["tiny_parity"]:  # with CUDA graphs; then the same without them
                stage(results, "tiny_parity_eager", lambda: isolated("tiny", str(work), "none", eager=True), needs=30)
                eager = "error" not in results["tiny_parity_eager"]
        if "kernel" in stages:
            stage(results, "kernel_tests", kernel_tests, needs=30)
        if started:
            time_one_b(started, results, eager)
        if "kernel" in stages:
            stage(results, "kernel_speed", lambda: isolated("kernel_speed"), needs=20)
    (OUT / "device_check.json").write_text(json.dumps(results, indent=2))
    (OUT / "device_check.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
