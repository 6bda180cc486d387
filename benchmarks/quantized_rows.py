"""What a quantized matmul call costs per number of rows: our Int4MatMul (Q4_0-style and Q4_1 with minimums) and
Int8MatMul (Q8_0) on the default model's shapes, for M = 1..16 rows (decode batches, verify trees, short prompt
chunks) and 64 (a block of a prompt chunk), on the tiles this CPU takes and on the AVX2 ones.

    python benchmarks/quantized_rows.py [--threads 2] [--repeats 200] [--json benchmarks/results/quantized_rows.json]

A call whose weights are read once for all its rows (and unpacked once) costs about what one row costs while it is
bound by the weight stream; this prints each call's time and its ratio to the one-row call, per shape, so the
"rows share the weight stream" property can be compared between commits. Each node runs in its own onnxruntime
session per kind of tiles with the kernel library built from this checkout; the median call of 3 x --repeats
after a warm-up, the kinds of tiles taking turns call by call.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.backends.onnxruntime import kernel_library_tiles  # noqa: E402
from plugins import int4_matmul, native_ops  # noqa: E402
from runner.core.machine import cpu_model  # noqa: E402

# (name, N, K) of the default model: the fused q/k/v, the MLP's gate+up and down, the LM head
SHAPES = [("qkv", 960, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]
ROWS = [1, 2, 4, 6, 8, 12, 16, 64]
KINDS = ["Q4_0", "Q4_1", "Q8_0"]


def session(library: Path, kind: str, n: int, k: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    bits = 8 if kind == "Q8_0" else 4
    weights = rng.integers(0, 256, (n, k // 32, 32 * bits // 8), dtype=np.uint8)
    scales = rng.random(n * k // 32, np.float32).astype(np.float16)
    constants = [  # in the kernels' column tiles, as a build stores them
        numpy_helper.from_array(int4_matmul.tile_weights(weights, bits), "w"),
        numpy_helper.from_array(int4_matmul.tile_per_block(scales, n), "s"),
    ]
    inputs = ["a", "w", "s"]
    if kind == "Q4_1":
        minimums = (-rng.random((n, k // 32))).astype(np.float16)
        constants.append(numpy_helper.from_array(int4_matmul.tile_per_block(minimums, n), "m"))
        inputs.append("m")
    op = "Int8MatMul" if bits == 8 else "Int4MatMul"
    node = helper.make_node(
        op, inputs, ["y"], domain=native_ops.DOMAIN, K=k, N=n, block_size=32, column_tile=int4_matmul.COLUMN_TILE
    )
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])],
        constants,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native_ops.DOMAIN, 1)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    # no spinning between calls: the sessions take turns, and one's spinning threads would slow the next one's call
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def session_on_tiles(library: Path, kind: str, n: int, k: int, threads: int, tiles: str):
    """session() whose kernel takes `tiles` (tile_choices': the CPU's best, or "avx2"), which a kernel reads from
    LLM_ENGINE_BUILDER_KERNEL_ISA when the session creates it."""
    os.environ.pop("LLM_ENGINE_BUILDER_KERNEL_ISA", None)
    if tiles == "avx2":
        os.environ["LLM_ENGINE_BUILDER_KERNEL_ISA"] = tiles
    try:
        return session(library, kind, n, k, threads)
    finally:
        os.environ.pop("LLM_ENGINE_BUILDER_KERNEL_ISA", None)


def call_us(runs: dict, a: np.ndarray, repeats: int) -> dict[str, float]:
    """Each session's median call over 3 x `repeats` calls, the sessions taking turns call by call (this VM's speed
    drifts by tens of percent within seconds: only calls timed side by side compare)."""
    for run in runs.values():
        for _ in range(20):
            run.run(None, {"a": a})
    times = {tiles: [] for tiles in runs}
    for _ in range(3 * repeats):
        for tiles, run in runs.items():
            start = time.perf_counter()
            run.run(None, {"a": a})
            times[tiles].append((time.perf_counter() - start) * 1e6)
    return {tiles: float(np.median(calls)) for tiles, calls in times.items()}


def measure(library: Path, threads: int, repeats: int, tile_kinds: list[str]) -> dict:
    """{tiles: {node: {rows: us per call}}} for every node kind, shape and row count, on each of `tile_kinds`."""
    results = {tiles: {} for tiles in tile_kinds}
    for kind in KINDS:
        for name, n, k in SHAPES:
            runs = {tiles: session_on_tiles(library, kind, n, k, threads, tiles) for tiles in tile_kinds}
            node = f"{kind} {name} {n}x{k}"
            for rows in ROWS:
                a = np.random.default_rng(rows).standard_normal((rows, k), dtype=np.float32)
                times = call_us(runs, a, max(10, repeats * 1000 // (n * k // 1000 + 1000)))
                for tiles, us in times.items():
                    results[tiles].setdefault(node, {})[rows] = us
    return results


def tile_choices(library: Path) -> list[str]:
    """The tiles to time on this CPU, as the kernels name them: its best ("avx512vnni" or "avx2"), then the AVX2
    ones where those are not its best."""
    best = kernel_library_tiles(library)
    return [best] if best == "avx2" else [best, "avx2"]


@click.command()
@click.option("--threads", type=int, default=2, show_default=True)
@click.option(
    "--repeats",
    type=int,
    default=200,
    show_default=True,
    help="A third of the calls timed per kind of tiles, for the smallest shape.",
)
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None)
def main(threads: int, repeats: int, json_path: Path | None) -> None:
    library = native_ops.compile_library(Path(tempfile.mkdtemp()))
    report = {"machine": cpu_model(), "threads": threads, "rows": ROWS}
    report["isas"] = measure(library, threads, repeats, tile_choices(library))
    for isa, results in report["isas"].items():
        click.echo(f"\n{report['machine']}, {threads} threads, {isa} tiles: us per call (x the one-row call)")
        click.echo(f"{'node':34}" + "".join(f"{f'M={m}':>16}" for m in ROWS))
        for node, times in results.items():
            cells = "".join(f"{times[m]:>8.0f} ({times[m] / times[1]:4.1f}x)" for m in ROWS)
            click.echo(f"{node:34}{cells}")
    if json_path:
        json_path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
