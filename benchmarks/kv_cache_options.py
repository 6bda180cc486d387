"""Measure the KV cache contracts for one decode step of one attention layer (the default model's shape).

    python benchmarks/kv_cache_options.py [--threads 2]

Options, each a one-layer ONNX graph run by onnxruntime at batch 1 for several cached lengths L:
  inputs_views   the engine's contract until artifact schema 2: the cache is an input fed as a view of the
                 runner's bucket-sized buffer (K stored transposed); scores against the cache and against the new
                 token are computed apart; only the new K/V come out and the runner writes them in place (its write
                 is included in the timing).
  concat         the common export: present = Concat(past, new) as an output, i.e. the whole cache is copied
                 every step and fed back.
  gqa_shared     com.microsoft::GroupQueryAttention with past and present bound to the same buffer through
                 IOBinding (onnxruntime-genai's contract, and ours since schema 2: plugins/attention.py): written in
                 place, cost follows the used length.
"""

from __future__ import annotations

import time

import click
import numpy as np

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
GROUP = HEADS // KV_HEADS


def _session(model, threads):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _model(nodes, inputs, outputs, domains=(("", 18),)):
    from onnx import helper

    graph = helper.make_graph(nodes, "attention", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in domains])


def _value(name, shape, elem=None):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, elem or TensorProto.FLOAT, shape)


def inputs_views(length: int, threads: int, reps: int) -> float:
    from onnx import helper

    nodes = [
        helper.make_node("MatMul", ["q", "past_key"], ["s_past"]),  # [1,3,G,D] x [1,3,D,L]
        helper.make_node("MatMul", ["q", "k_t"], ["s_new"]),  # [1,3,G,1]
        helper.make_node("Concat", ["s_past", "s_new"], ["s"], axis=-1),
        helper.make_node("Add", ["s", "bias"], ["s_masked"]),
        helper.make_node("Softmax", ["s_masked"], ["p"], axis=-1),
        helper.make_node("Split", ["p", "split"], ["p_past", "p_new"], axis=-1),
        helper.make_node("MatMul", ["p_past", "past_value"], ["o_past"]),
        helper.make_node("MatMul", ["p_new", "v"], ["o_new"]),
        helper.make_node("Add", ["o_past", "o_new"], ["out"]),
    ]
    model = _model(
        nodes,
        [
            _value("q", [1, KV_HEADS, GROUP, HEAD_DIM]),
            _value("k_t", [1, KV_HEADS, HEAD_DIM, 1]),
            _value("v", [1, KV_HEADS, 1, HEAD_DIM]),
            _value("past_key", [1, KV_HEADS, HEAD_DIM, "L"]),
            _value("past_value", [1, KV_HEADS, "L", HEAD_DIM]),
            _value("bias", [1, 1, GROUP, "L1"]),
            _value("split", [2], 7),
        ],
        [_value("out", [1, KV_HEADS, GROUP, HEAD_DIM])],
    )
    session = _session(model, threads)
    keys = np.random.rand(1, KV_HEADS, HEAD_DIM, length).astype(np.float32)
    values = np.random.rand(1, KV_HEADS, length, HEAD_DIM).astype(np.float32)
    feeds = {
        "q": np.random.rand(1, KV_HEADS, GROUP, HEAD_DIM).astype(np.float32),
        "k_t": np.random.rand(1, KV_HEADS, HEAD_DIM, 1).astype(np.float32),
        "v": np.random.rand(1, KV_HEADS, 1, HEAD_DIM).astype(np.float32),
        "past_key": keys,
        "past_value": values,
        "bias": np.zeros((1, 1, GROUP, length + 1), np.float32),
        "split": np.array([length, 1], np.int64),
    }

    def step(position=length // 2):
        session.run(None, feeds)
        keys[0, :, :, position] = feeds["k_t"][0, :, :, 0]  # the runner's in-place write of the new K/V
        values[0, :, position] = feeds["v"][0, :, 0]

    return _time(step, reps)


def concat(length: int, threads: int, reps: int) -> float:
    from onnx import helper

    nodes = [
        helper.make_node("Concat", ["past_key", "k"], ["present_key"], axis=2),  # [1,3,L+1,D]
        helper.make_node("Concat", ["past_value", "v"], ["present_value"], axis=2),
        helper.make_node("Transpose", ["present_key"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "k_t"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "present_value"], ["out"]),
    ]
    model = _model(
        nodes,
        [
            _value("q", [1, KV_HEADS, GROUP, HEAD_DIM]),
            _value("k", [1, KV_HEADS, 1, HEAD_DIM]),
            _value("v", [1, KV_HEADS, 1, HEAD_DIM]),
            _value("past_key", [1, KV_HEADS, "L", HEAD_DIM]),
            _value("past_value", [1, KV_HEADS, "L", HEAD_DIM]),
        ],
        [
            _value("out", [1, KV_HEADS, GROUP, HEAD_DIM]),
            _value("present_key", [1, KV_HEADS, "L1", HEAD_DIM]),
            _value("present_value", [1, KV_HEADS, "L1", HEAD_DIM]),
        ],
    )
    session = _session(model, threads)
    state = {"k": np.random.rand(1, KV_HEADS, length, HEAD_DIM).astype(np.float32)}
    state["v"] = state["k"].copy()
    q = np.random.rand(1, KV_HEADS, GROUP, HEAD_DIM).astype(np.float32)
    new = np.random.rand(1, KV_HEADS, 1, HEAD_DIM).astype(np.float32)

    def step():
        out = session.run(None, {"q": q, "k": new, "v": new, "past_key": state["k"], "past_value": state["v"]})
        # keep L fixed across repetitions: the cost is that of a cache of this length
        state["k"], state["v"] = out[1][:, :, 1:], out[2][:, :, 1:]

    return _time(step, reps)


def gqa_shared(length: int, threads: int, reps: int) -> float:
    import onnxruntime as ort
    from onnx import TensorProto, helper

    max_len = length + 8
    node = helper.make_node(
        "GroupQueryAttention",
        ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"],
        ["out", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
    )
    model = _model(
        [node],
        [
            _value("query", [1, 1, HEADS * HEAD_DIM]),
            _value("key", [1, 1, KV_HEADS * HEAD_DIM]),
            _value("value", [1, 1, KV_HEADS * HEAD_DIM]),
            _value("past_key", [1, KV_HEADS, max_len, HEAD_DIM]),
            _value("past_value", [1, KV_HEADS, max_len, HEAD_DIM]),
            _value("seqlens_k", [1], TensorProto.INT32),
            _value("total_sequence_length", [], TensorProto.INT32),
        ],
        [
            _value("out", [1, 1, HEADS * HEAD_DIM]),
            _value("present_key", [1, KV_HEADS, max_len, HEAD_DIM]),
            _value("present_value", [1, KV_HEADS, max_len, HEAD_DIM]),
        ],
        domains=(("", 18), ("com.microsoft", 1)),
    )
    session = _session(model, threads)
    keys = ort.OrtValue.ortvalue_from_numpy(np.random.rand(1, KV_HEADS, max_len, HEAD_DIM).astype(np.float32))
    values = ort.OrtValue.ortvalue_from_numpy(np.random.rand(1, KV_HEADS, max_len, HEAD_DIM).astype(np.float32))
    binding = session.io_binding()
    for name, shape in (("query", HEADS), ("key", KV_HEADS), ("value", KV_HEADS)):
        binding.bind_cpu_input(name, np.random.rand(1, 1, shape * HEAD_DIM).astype(np.float32))
    binding.bind_ortvalue_input("past_key", keys)
    binding.bind_ortvalue_input("past_value", values)
    binding.bind_ortvalue_output("present_key", keys)
    binding.bind_ortvalue_output("present_value", values)
    binding.bind_cpu_input("seqlens_k", np.array([length], np.int32))  # tokens before this one
    binding.bind_cpu_input("total_sequence_length", np.array(length + 1, np.int32))
    binding.bind_output("out")
    return _time(lambda: session.run_with_iobinding(binding), reps)


def _time(step, reps: int) -> float:
    for _ in range(10):
        step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


OPTIONS = {"inputs_views": inputs_views, "concat": concat, "gqa_shared": gqa_shared}


@click.command()
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--reps", type=int, default=300, show_default=True)
@click.option("--lengths", default="64,256,1024,2048", show_default=True)
def main(threads: int, reps: int, lengths: str) -> None:
    sizes = [int(x) for x in lengths.split(",")]
    print(
        f"one attention layer, decode, batch 1, {HEADS} heads / {KV_HEADS} KV heads x {HEAD_DIM}, {threads} threads: "
        "us per step"
    )
    print(f"{'option':<14}" + "".join(f"{'L=' + str(n):>10}" for n in sizes))
    for name, option in OPTIONS.items():
        print(f"{name:<14}" + "".join(f"{option(n, threads, reps):>10.1f}" for n in sizes))


if __name__ == "__main__":
    main()
