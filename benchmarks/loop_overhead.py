"""The Python around each decode step: our engine's greedy decode against a bare loop over the same bound decode
graph, which only rebinds the attention bias and feeds the step's argmax back as the next token, their runs
alternating in one process so that the machine's drift cancels.

It bounds what trimming the engine's Python could gain: the bare loop is the least a Python loop over this graph
does per token (no scheduler, no sampler, no detokenizer, no stop checks), so the engine can at most reach its
speed. Both times come from the same clock around the graph call: the gap is the median time from the end of one
decode call to the start of the next.

A third contender in the same rounds runs the decode graph's matmuls alone (`MatmulsAlone`: the same weights and
kernels, one row each, back to back), the floor under the graph: what the bare loop takes beyond it is the graph's
other nodes (attention, norms, activations, the executor between nodes) and the loop itself.

    python benchmarks/loop_overhead.py --engine engines-out/int4-rtn [--rounds 8] [--prompt short]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import source_commit  # noqa: E402
from runner.core.args import EngineArgs  # noqa: E402
from runner.core.engine import LLMEngine  # noqa: E402
from runner.tools.bench import greedy_fixed_length, time_generation  # noqa: E402


@dataclass(frozen=True)
class LoopRun:
    decode_tok_s: float
    gap_us: float  # median time between the end of one decode graph call and the start of the next
    tokens: list[int]


class GraphCallClock:
    """Times every call of a session's run_with_iobinding (the engine's decode calls and the bare loop's alike)."""

    def __init__(self, session) -> None:
        self.calls: list[tuple[float, float]] = []
        run = session.run_with_iobinding

        def timed(*args, **kwargs):
            start = time.perf_counter()
            run(*args, **kwargs)
            self.calls.append((start, time.perf_counter()))

        session.run_with_iobinding = timed


def median_gap_us(calls: list[tuple[float, float]]) -> float:
    """The median time between the end of one call and the start of the next, of (start, end) pairs."""
    return statistics.median(b[0] - a[1] for a, b in zip(calls, calls[1:])) * 1e6


class BareDecodeLoop:
    """The engine's decode graph bound once on cache row 0, with every input but the attention bias (whose length
    grows each step) in arrays refilled in place, and its outputs in fixed arrays."""

    def __init__(self, engine: LLMEngine) -> None:
        executor = engine.executor
        model = engine.manifest.model
        keys, values = executor.cache.views(0, 1)
        self.arrays = {
            f"{kind}_{part}.{i}": buffer
            for i, (k, v) in enumerate(zip(keys, values))
            for part, buffer in (("key", k), ("value", v))
            for kind in ("past", "present")
        }
        self.arrays |= {
            name: np.zeros(shape, np.int64)
            for name, shape in (
                ("input_ids", (1, 1)),
                ("positions", (1, 1)),
                ("past_lens", 1),
                ("logits_index", (1, 1)),
            )
        }
        self.arrays["query_lens"] = np.ones(1, np.int64)
        self.arrays |= {
            "logits": np.empty((1, 1, model.vocab_size), np.float32),
            "argmax": np.empty((1, 1), np.int64),
            "hidden": np.empty((1, 1, model.hidden_size), np.float32),
        }
        bound = executor.backend.bind(executor.decode_phase.graph, self.arrays)  # by address, for good
        self.session, self.binding = bound.session, bound.binding
        self.zero_bias = np.zeros(engine.max_seq_len + 1, np.float32)

    def decode(self, token: int, start: int, count: int) -> list[int]:
        """`count` greedy tokens after `token` at position `start` (that many cached in row 0)."""
        a = self.arrays
        a["input_ids"][0, 0] = token
        tokens = []
        for position in range(start, start + count):
            a["positions"][0, 0] = a["past_lens"][0] = position
            self.binding.bind_input(
                "attention_bias", "cpu", 0, np.float32, [1, 1, 1, position + 1], self.zero_bias.ctypes.data
            )
            self.session.run_with_iobinding(self.binding)
            a["input_ids"][0, 0] = a["argmax"][0, 0]
            tokens.append(int(a["argmax"][0, 0]))
        return tokens


QUANTIZED_MATMULS = ("Int4MatMul", "MatMulNBits")  # ours (plugins/int4_matmul.py) and onnxruntime's


class MatmulsAlone:
    """The decode graph's weight matmuls (Int4MatMul, MatMulNBits, or MatMul with a constant weight) alone, in their
    order, each on one row of its own fixed input, in a session with the engine's options: what a decode call's
    matmuls cost with nothing between them. The graph is written to `scratch` (the weights once more: ~80 MiB for the
    int4 default)."""

    def __init__(self, engine: LLMEngine, scratch: Path, threads: int | None) -> None:
        import onnx
        import onnxruntime as ort
        from onnx import helper

        from engines.backends.onnxruntime import register_native_libraries, session_options

        graph_file = engine.artifact.path(engine.manifest.graphs[engine.executor.decode_phase.graph].file)
        model = onnx.load(str(graph_file))
        constants = {i.name: i for i in model.graph.initializer}
        made_by = {out: node for node in model.graph.node for out in node.output}
        nodes, shapes, used = [], [], []  # shapes: each matmul's (K, N)
        for node in model.graph.node:
            weight = node.input[1] if node.op_type in QUANTIZED_MATMULS + ("MatMul",) and len(node.input) > 1 else None
            # the matmul alone: an activation folded into it (Int4MatMul's swiglu) is not part of a matmul's cost
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name != "swiglu"}
            transpose = made_by.get(weight)
            if transpose is not None and transpose.op_type == "Transpose" and transpose.input[0] in constants:
                nodes.append(transpose)  # a tied LM head's transposed embedding (onnxruntime folds it once)
                used.append(transpose.input[0])
                shapes.append(tuple(reversed(constants[transpose.input[0]].dims)))
            elif weight in constants:
                shapes.append(
                    (attributes["K"], attributes["N"])
                    if node.op_type in QUANTIZED_MATMULS
                    else tuple(constants[weight].dims)
                )
            else:
                continue
            nodes.append(
                helper.make_node(
                    node.op_type,
                    [f"x{shapes[-1][0]}", *node.input[1:]],
                    [f"y{len(shapes)}"],
                    domain=node.domain,
                    **attributes,
                )
            )
            used += [name for name in node.input[1:] if name in constants]
        if not shapes:
            raise ValueError(f"{graph_file.name} has no matmul with a constant weight")
        self.matmuls = len(shapes)
        features = sorted({k for k, _ in shapes})
        graph = helper.make_graph(
            nodes,
            "matmuls_alone",
            [helper.make_tensor_value_info(f"x{k}", onnx.TensorProto.FLOAT, [1, k]) for k in features],
            [
                helper.make_tensor_value_info(f"y{i + 1}", onnx.TensorProto.FLOAT, [1, n])
                for i, (_, n) in enumerate(shapes)
            ],
            [constants[name] for name in dict.fromkeys(used)],
        )
        path = scratch / "matmuls_alone.onnx"
        onnx.save(
            helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version),
            str(path),
            save_as_external_data=True,
            location=path.name + ".data",
        )
        del model, graph, constants  # the whole decode graph's weights, in memory while the copy was made
        options = session_options(ort, threads, spinning=True)
        register_native_libraries(options, engine.artifact)  # our Int4MatMul
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        self.arrays = {f"x{k}": rng.standard_normal((1, k), np.float32) for k in features}
        self.arrays |= {f"y{i + 1}": np.empty((1, n), np.float32) for i, (_, n) in enumerate(shapes)}
        self.binding = self.session.io_binding()
        for name, array in self.arrays.items():
            bind = self.binding.bind_input if name.startswith("x") else self.binding.bind_output
            bind(name, "cpu", 0, np.float32, list(array.shape), array.ctypes.data)

    def run(self, count: int) -> LoopRun:
        calls = []
        start = time.perf_counter()
        for _ in range(count):
            begin = time.perf_counter()
            self.session.run_with_iobinding(self.binding)
            calls.append((begin, time.perf_counter()))
        seconds = time.perf_counter() - start
        return LoopRun(count / seconds, median_gap_us(calls), [])


def engine_run(engine: LLMEngine, clock: GraphCallClock, ids: list[int], count: int) -> LoopRun:
    clock.calls.clear()
    timing = time_generation(engine, ids, count)
    decode_calls = clock.calls[1:]  # the first call is the prompt's
    return LoopRun(timing.decode_tok_s, median_gap_us(decode_calls), list(timing.first_tokens))


def bare_run(engine: LLMEngine, loop: BareDecodeLoop, clock: GraphCallClock, ids: list[int], count: int) -> LoopRun:
    """The prompt and first token through the engine, then `count - 1` tokens by the bare loop."""
    request = engine.add_request(None, ids, greedy_fixed_length(count))
    while not request.output_token_ids:
        engine.step()
    clock.calls.clear()
    start = time.perf_counter()
    tokens = loop.decode(request.output_token_ids[-1], request.num_computed, count - 1)
    seconds = time.perf_counter() - start
    engine.abort(request)
    return LoopRun((count - 1) / seconds, median_gap_us(clock.calls), (request.output_token_ids + tokens)[:16])


def loop_overhead(engine_dir: str, ids: list[int], rounds: int, new_tokens: int, threads: int | None) -> dict:
    engine = LLMEngine(EngineArgs(engine_dir, threads=threads, max_batch=1))
    loop = BareDecodeLoop(engine)
    clock = GraphCallClock(loop.session)
    with tempfile.TemporaryDirectory() as scratch:
        matmuls = MatmulsAlone(engine, Path(scratch), threads)
    contenders = {
        "engine": lambda count: engine_run(engine, clock, ids, count),
        "bare": lambda count: bare_run(engine, loop, clock, ids, count),
        "matmuls": lambda count: matmuls.run(count - 1),  # one call per decoded token, as the bare loop makes
    }
    for run in contenders.values():  # warm-up
        run(16)
    runs: dict[str, list[LoopRun]] = {name: [] for name in contenders}
    for round_ in range(rounds):
        order = list(contenders) if round_ % 2 == 0 else list(reversed(contenders))
        for name in order:
            runs[name].append(contenders[name](new_tokens))
    if runs["engine"][0].tokens != runs["bare"][0].tokens:
        raise SystemExit(
            f"the bare loop's greedy tokens differ from the engine's: {runs['bare'][0].tokens} "
            f"against {runs['engine'][0].tokens}"
        )

    def paired(numerator: str, denominator: str) -> list[float]:
        return [n.decode_tok_s / d.decode_tok_s for n, d in zip(runs[numerator], runs[denominator])]

    ratios, engine_share, bare_share = paired("bare", "engine"), paired("engine", "matmuls"), paired("bare", "matmuls")
    return {
        name: {
            "decode_tok_s": statistics.median(r.decode_tok_s for r in rs),
            "gap_us": statistics.median(r.gap_us for r in rs),
            "runs": [asdict(r) for r in rs],
        }
        for name, rs in runs.items()
    } | {
        "bare_over_engine": statistics.median(ratios),
        "lowest": min(ratios),
        "highest": max(ratios),
        "rounds": rounds,
        # the matmuls' time as a share of a token's, round by round: tok/s of the token over calls/s of the matmuls
        "matmul_nodes": matmuls.matmuls,
        "matmuls_share_of_engine": statistics.median(engine_share),
        "matmuls_share_of_bare": statistics.median(bare_share),
    }


@click.command()
@click.option("--engine", required=True, type=click.Path(exists=True))
@click.option("--prompt", type=click.Choice(["short", "long"]), default="short", show_default=True)
@click.option("--rounds", type=int, default=8, show_default=True)
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Also write the result as JSON.")
def main(engine, prompt, rounds, new_tokens, threads, out) -> None:
    from runner.core.machine import cpu_model
    from runner.tools.bench import chat_prompts

    ids = chat_prompts(LLMEngine(EngineArgs(engine, verify_checksums=False)).codec)[prompt]
    result = loop_overhead(engine, ids, rounds, new_tokens, threads)
    commit = source_commit()
    result |= {
        "engine_dir": engine,
        "prompt": prompt,
        "prompt_tokens": len(ids),
        "machine": f"{cpu_model()}, {threads} threads",
        "commit": commit,
    }
    print(
        f"{engine}, {prompt} prompt ({len(ids)} tokens), {result['machine']}, commit {commit}, {rounds} alternating "
        "rounds "
        f"of {new_tokens} greedy tokens"
    )
    for name in ("engine", "bare"):
        print(
            f"  {name:6s} {result[name]['decode_tok_s']:7.1f} tok/s, {result[name]['gap_us']:5.0f} us between decode "
            "calls"
        )
    print(
        f"  bare loop / engine: {result['bare_over_engine']:.3f}x paired "
        f"({result['lowest']:.3f}-{result['highest']:.3f}x)"
    )
    print(
        f"  the {result['matmul_nodes']} matmuls alone: {1e3 / result['matmuls']['decode_tok_s']:.2f} ms per call, "
        f"{result['matmuls_share_of_engine']:.0%} of the engine's time per token, "
        f"{result['matmuls_share_of_bare']:.0%} "
        "of the bare loop's (paired)"
    )
    if out:
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
