"""What one row's step costs per number of query tokens: the step graph called with 1 .. 16 tokens of one row after
a cached context, as a decode step (1 token), a speculative verify step (a draft tree's nodes) or a short prompt
chunk calls it; with --rows, also decode steps of several rows (one token each, every row after the same context),
as a decode batch calls it. Prints each call's time and its ratio to the one-token call.

    python benchmarks/step_tokens.py ENGINE [--context 100] [--threads 2] [--rows 8 ...] [--library LIB ...]
                                     [--json FILE]

The graph alone, in onnxruntime's own session as the runner opens it (the engine's kernel library registered, the same
thread settings), its cache of --context positions (zeros of the engine's cache dtype, float or int8: the attention's
work depends on the count, not the values)
bound in place as the runner binds its cache (fed as plain inputs instead, every call would first copy the whole
cache buffer into its outputs: 5.9 MB at 100 positions for the default model, 32 MB at 650), and a causal bias; best
of 3 passes of --repeats calls, each after 5 untimed ones, the token counts interleaved within each pass so that the
machine's drift favours none. A verify step whose weights are read once for all its tokens costs about what a decode
step costs while the weight stream bounds it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import source_commit  # noqa: E402
from engines.backends.onnxruntime import BoundGraph, register_native_libraries, session_options  # noqa: E402
from engines.format import open_artifact  # noqa: E402
from runner.core.machine import cpu_model  # noqa: E402

TOKENS = list(range(1, 17))
_DTYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int8)": np.int8}


def step_feeds(session, tokens: int, context: int, rows: int = 1) -> dict[str, np.ndarray]:
    """`rows` alike: each `tokens` new positions after `context` cached ones (the cache buffer rounded up to 64)."""
    total = context + tokens
    capacity = -(-total // 64) * 64
    bias = np.where(np.arange(total)[None, :] <= context + np.arange(tokens)[:, None], 0.0, -np.inf)
    feeds = {
        "input_ids": np.full((rows, tokens), 100, np.int64),
        "positions": np.tile(np.arange(context, total, dtype=np.int64), (rows, 1)),
        "past_lens": np.full(rows, context, np.int64),
        "query_lens": np.full(rows, tokens, np.int64),
        "attention_bias": np.tile(bias.astype(np.float32), (rows, 1, 1, 1)),
        "logits_index": np.tile(np.arange(tokens, dtype=np.int64), (rows, 1)),
    }
    for spec in session.get_inputs():
        if spec.name.startswith(("past_key", "past_value")):
            feeds[spec.name] = np.zeros((rows, spec.shape[1], capacity, spec.shape[3]), _DTYPES[spec.type])
    return feeds


def measure(
    engine: Path,
    threads: int,
    context: int,
    repeats: int,
    libraries: list[Path] | None = None,
    rows: tuple[int, ...] = (),
) -> dict[str, dict[int | str, float]]:
    """ms per call, per kernel library (the engine's own, "engine", or each of `libraries`, a library built from
    another checkout say, in its place; their calls interleaved) and per call: one row's 1 .. 16 tokens (keys 1 ..
    16), and a decode step of each of `rows` rows (keys "R rows")."""
    artifact = open_artifact(engine)
    graphs = {}
    for library in libraries or [None]:
        session = step_session(artifact, threads, library)
        graphs["engine" if library is None else str(library)] = bound_steps(session, context, rows)
    calls = [*TOKENS, *(f"{count} rows" for count in rows)]
    best = {name: dict.fromkeys(calls, float("inf")) for name in graphs}
    for _ in range(3):
        for call in calls:
            for name, steps in graphs.items():
                graph, inputs, outputs = steps[call]
                for _ in range(5):  # a new shape's first calls set up its buffers
                    graph.run(inputs, outputs)
                start = time.perf_counter()
                for _ in range(repeats):
                    graph.run(inputs, outputs)
                best[name][call] = min(best[name][call], (time.perf_counter() - start) / repeats * 1000)
    return best


def step_session(artifact, threads: int, library: Path | None = None, spinning: bool = True):
    """The artifact's step graph in an onnxruntime session as the runner opens it, with the engine's kernel library
    registered, or `library` in its place."""
    import onnxruntime as ort

    options = session_options(ort, threads, spinning=spinning)
    if library is None:
        register_native_libraries(options, artifact)
    else:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(
        str(artifact.path(artifact.manifest.graphs["step"].file)), options, providers=["CPUExecutionProvider"]
    )


def bound_steps(session, context: int, rows: tuple[int, ...] = ()) -> dict[int | str, tuple[BoundGraph, dict, dict]]:
    """Per call (one row's token counts, then "R rows"), the session with a cache bound in place (each layer's array
    as both its past and its present: one for the one-row calls, one per row count), the call's inputs and its
    output arrays."""
    steps = {}
    for count, calls in [(1, {t: t for t in TOKENS}), *((r, {f"{r} rows": 1}) for r in rows)]:
        feeds = {call: step_feeds(session, tokens, context, count) for call, tokens in calls.items()}
        largest = feeds[list(calls)[-1]]
        cache = {name: array for name, array in largest.items() if name.startswith(("past_key", "past_value"))}
        cache |= {name.replace("past_", "present_"): array for name, array in cache.items()}
        graph = BoundGraph(session, cache)
        for call, tokens in calls.items():
            outputs = {
                o.name: np.empty((count, tokens, *o.shape[2:]), _DTYPES[o.type])
                for o in session.get_outputs()
                if o.name not in cache
            }
            steps[call] = (graph, {k: v for k, v in feeds[call].items() if k not in cache}, outputs)
    return steps


@click.command()
@click.argument("engine", type=click.Path(exists=True, path_type=Path))
@click.option("--context", type=int, default=100, show_default=True, help="Cached positions before the step.")
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--repeats", type=int, default=30, show_default=True, help="Calls per pass and token count.")
@click.option(
    "--library",
    "libraries",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A kernel library to run the engine's graph with instead of its own (repeat it to compare several; "
    "`python -c 'from plugins import native_ops; native_ops.compile_library(...)'` builds one from a checkout).",
)
@click.option(
    "--rows",
    type=click.IntRange(min=2),
    multiple=True,
    help="Also time a decode step of this many rows, one token each (repeatable; one row is the 1-token call).",
)
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None)
def main(
    engine: Path,
    context: int,
    threads: int,
    repeats: int,
    libraries: tuple[Path, ...],
    rows: tuple[int, ...],
    json_path: Path | None,
) -> None:
    curves = measure(engine, threads, context, repeats, list(libraries), rows)
    machine = cpu_model()
    print(f"\n{machine}, {threads} threads, {engine}, {context} cached positions: ms per step call (x one token)")
    for name, times in curves.items():
        print(name)
        for call, ms in times.items():
            label = f"{call} tokens" if isinstance(call, int) else f"{call}, 1 token each"
            print(f"{label:>22} {ms:8.2f} ({ms / times[1]:.2f}x)")
    if json_path:
        report = {"machine": machine, "commit": source_commit(), "threads": threads, "engine": str(engine)}
        report |= {"context": context, "ms": curves}
        json_path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
