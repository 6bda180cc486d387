"""What one row's step costs per number of query tokens: the step graph called with 1 .. 16 tokens of one row after
a cached context, as a decode step (1 token), a speculative verify step (a draft tree's nodes) or a short prompt
chunk calls it. Prints each call's time and its ratio to the one-token call.

    python benchmarks/step_tokens.py ENGINE [--context 100] [--threads 2] [--json benchmarks/results/step_tokens.json]

The graph alone, bound by onnxruntime's own session as the runner opens it (the engine's kernel library
registered, the same thread settings), fed a cache of --context positions (zeros: the attention's work depends on
the count, not the values) and a causal bias; best of 3 passes of --repeats calls, each after 5 untimed ones, the token
counts interleaved within each pass so that the machine's drift favours none. A verify step whose weights are read once
for all its tokens costs about what a decode step costs while the weight stream bounds it.
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
from engines.backends.onnxruntime import register_native_libraries, session_options  # noqa: E402
from engines.format import open_artifact  # noqa: E402
from runner.core.machine import cpu_model  # noqa: E402

TOKENS = list(range(1, 17))


def step_feeds(session, tokens: int, context: int) -> dict[str, np.ndarray]:
    """One row: `tokens` new positions after `context` cached ones (the cache buffer rounded up to 64)."""
    total = context + tokens
    capacity = -(-total // 64) * 64
    feeds = {
        "input_ids": np.full((1, tokens), 100, np.int64),
        "positions": np.arange(context, total, dtype=np.int64)[None],
        "past_lens": np.array([context], np.int64),
        "query_lens": np.array([tokens], np.int64),
        "attention_bias": np.where(
            np.arange(total)[None, :] <= context + np.arange(tokens)[:, None], 0.0, -np.inf
        ).astype(np.float32)[None, None],
        "logits_index": np.arange(tokens, dtype=np.int64)[None],
    }
    for spec in session.get_inputs():
        if spec.name.startswith(("past_key", "past_value")):
            feeds[spec.name] = np.zeros((1, spec.shape[1], capacity, spec.shape[3]), np.float32)
    return feeds


def measure(engine: Path, threads: int, context: int, repeats: int) -> dict[int, float]:
    import onnxruntime as ort

    artifact = open_artifact(engine)
    options = session_options(ort, threads, spinning=True)
    register_native_libraries(options, artifact)
    session = ort.InferenceSession(
        str(artifact.path(artifact.manifest.graphs["step"].file)), options, providers=["CPUExecutionProvider"]
    )
    feeds = {tokens: step_feeds(session, tokens, context) for tokens in TOKENS}
    best = dict.fromkeys(TOKENS, float("inf"))
    for _ in range(3):
        for tokens in TOKENS:
            for _ in range(5):  # a new shape's first calls set up its buffers
                session.run(["argmax"], feeds[tokens])
            start = time.perf_counter()
            for _ in range(repeats):
                session.run(["argmax"], feeds[tokens])
            best[tokens] = min(best[tokens], (time.perf_counter() - start) / repeats * 1000)
    return best


@click.command()
@click.argument("engine", type=click.Path(exists=True, path_type=Path))
@click.option("--context", type=int, default=100, show_default=True, help="Cached positions before the step.")
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--repeats", type=int, default=30, show_default=True, help="Calls per pass and token count.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None)
def main(engine: Path, context: int, threads: int, repeats: int, json_path: Path | None) -> None:
    times = measure(engine, threads, context, repeats)
    machine = cpu_model()
    print(f"\n{machine}, {threads} threads, {engine}, {context} cached positions: ms per step call (x one token)")
    for tokens, ms in times.items():
        print(f"{tokens:>3} tokens {ms:8.2f} ({ms / times[1]:.2f}x)")
    if json_path:
        report = {"machine": machine, "commit": source_commit(), "threads": threads, "engine": str(engine)}
        report |= {"context": context, "ms": times}
        json_path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
