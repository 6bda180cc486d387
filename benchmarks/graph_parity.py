"""Decode graphs alone, side by side in one process: onnxruntime-genai's decoder (its model.onnx) run by our
onnxruntime backend, with our session options and IO binding, against our step graph through `Executor.decode`,
their calls interleaved one by one so that the machine's drift cancels.

It separates a graph from the loop that drives it: the end-to-end decode ratio of `compare_peers.py` minus this
one is what each engine spends per token outside its graph (ours in Python, onnxruntime-genai's in C++). Run
alone, each in its own process, the two engines' speeds move between processes on a shared VM by more than the
gap measured; call by call in one process the ratio is steady (docs/measurements.md, Benchmark method).

    python benchmarks/graph_parity.py --ours engines-out/int4-rtn --peer engines-out/peers/ort-genai-int4
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class GraphParity:
    ours_ms: float  # median time of one decode call
    peer_ms: float
    ours_over_peer: float  # median over the calls of ours / theirs, the two timed back to back: > 1, ours is slower
    calls: int
    first_position: int  # the calls decode positions first_position .. first_position + span - 1, round and round
    span: int


class PeerDecoder:
    """onnxruntime-genai's decoder graph, one token per call, its KV cache (past and present sharing one buffer per
    layer, as onnxruntime-genai runs it) bound once."""

    def __init__(self, model_dir: Path, threads: int, max_len: int) -> None:
        import onnxruntime as ort

        from engines.backends.onnxruntime import session_options

        config = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
        self.session = ort.InferenceSession(
            str(model_dir / config["filename"]),
            session_options(ort, threads, spinning=True),
            providers=["CPUExecutionProvider"],
        )
        self.names = config["inputs"] | config["outputs"]
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.binding = self.session.io_binding()
        # filled, not zeros: untouched pages all map the kernel's zero page, which reads faster than a real cache
        rng = np.random.default_rng(0)
        shape = (1, config["num_key_value_heads"], max_len, config["head_size"])
        self.cache = []
        for layer in range(config["num_hidden_layers"]):
            for past, present in (("past_key_names", "present_key_names"), ("past_value_names", "present_value_names")):
                buffer = (0.1 * rng.standard_normal(shape)).astype(np.float32)
                self.cache.append(buffer)
                for name, bind in (
                    (self.names[past] % layer, self.binding.bind_input),
                    (self.names[present] % layer, self.binding.bind_output),
                ):
                    bind(name, "cpu", 0, np.float32, list(shape), buffer.ctypes.data)
        self.vocab_size = self.session.get_outputs()[0].shape[-1]

    def __call__(self, token: int, position: int) -> None:
        self.binding.bind_cpu_input(self.names["input_ids"], np.array([[token]], np.int64))
        self.binding.bind_cpu_input(self.names["attention_mask"], np.ones((1, position + 1), np.int64))
        if "position_ids" in self.input_names:
            self.binding.bind_cpu_input("position_ids", np.array([[position]], np.int64))
        logits = np.empty((1, 1, self.vocab_size), np.float32)  # as our decode call, a fresh array per call
        self.binding.bind_output(self.names["logits"], "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(self.binding)


def graph_parity(
    ours: Path, peer: Path, prompt_ids: list[int], threads: int, calls: int = 600, span: int = 64
) -> GraphParity:
    """Decode calls of both graphs after a prompt, alternating which goes first; the positions cycle through `span`
    (the pages of ours are written by a first pass, so that neither reads untouched memory)."""
    from runner.core.args import EngineArgs
    from runner.core.engine import LLMEngine

    executor = LLMEngine(EngineArgs(ours, threads=threads, max_batch=1)).executor
    executor.prefill(0, prompt_ids, 0)
    first = len(prompt_ids)
    token = prompt_ids[-1]
    for position in range(first, first + span):
        executor.decode([0], [token], [position])
    theirs = PeerDecoder(peer, threads, first + span)
    for position in range(first, first + span):
        theirs(token, position)
    ours_s, peer_s = [], []
    for call in range(calls):
        position = first + call % span
        pair = [
            (ours_s, lambda position=position: executor.decode([0], [token], [position])),
            (peer_s, lambda position=position: theirs(token, position)),
        ]
        for times, run in pair if call % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return GraphParity(
        statistics.median(ours_s) * 1000,
        statistics.median(peer_s) * 1000,
        statistics.median(o / p for o, p in zip(ours_s, peer_s)),
        calls,
        first,
        span,
    )


def parity_markdown(ours_label: str, peer_label: str, parity: dict) -> str:
    return (
        f"Decode graphs alone (`benchmarks/graph_parity.py`: {peer_label}'s model.onnx run by our runtime with our "
        f"session options, {parity['calls']} calls of each interleaved in one process, positions "
        f"{parity['first_position']}-{parity['first_position'] + parity['span'] - 1}): {ours_label} "
        f"{parity['ours_ms']:.2f} ms per call, {peer_label} {parity['peer_ms']:.2f} ms; ours / theirs per call "
        f"{parity['ours_over_peer']:.3f} (> 1: our graph is slower). What the end-to-end ratio adds to this is the "
        f"loop around each graph."
    )


@click.command()
@click.option("--ours", required=True, type=click.Path(exists=True, path_type=Path), help="Our engine.")
@click.option(
    "--peer",
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="An onnxruntime-genai model folder (genai_config.json, model.onnx).",
)
@click.option(
    "--prompt-tokens", type=int, default=40, show_default=True, help="Cached positions before the timed calls."
)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--calls", type=int, default=600, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON line.")
def main(ours, peer, prompt_tokens, threads, calls, as_json) -> None:
    prompt_ids = [int(t) for t in np.random.default_rng(0).integers(100, 20000, prompt_tokens)]
    parity = asdict(graph_parity(ours, peer, prompt_ids, threads, calls))
    click.echo(json.dumps(parity) if as_json else parity_markdown(ours.name, peer.name, parity))


if __name__ == "__main__":
    main()
