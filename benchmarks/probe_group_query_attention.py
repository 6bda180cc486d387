"""Can onnxruntime's fused com.microsoft::GroupQueryAttention replace our per-layer attention subgraph?

    python benchmarks/probe_group_query_attention.py

The peers comparison (README, "Against the peers") shows onnxruntime-genai's int4 graph decoding ~1.5x faster than
ours with the same MatMulNBits time: it runs ~11 nodes per layer, we run ~38, most of them the attention written
out in plain ops. This probe checks, against numpy, that the fused CPU kernel of this onnxruntime serves what our
engine needs, before the model is moved onto it:
1. decode: packed QKV in, rotary inside, rows with different cached lengths in one batch, and the runner's own
   numpy cache bound in place as past and present (IO binding), so the new K/V land in it with no copy;
2. tree verify: several new tokens per row with rotary at their tree depth (position_ids) and a tree mask
   (attention_bias) on top of the kernel's causal mask;
and times one node at batch 1. Exits non-zero if a check fails.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

HEADS, KV_HEADS, HEAD_DIM, MAX_POSITIONS = 9, 3, 64, 2048  # the default model's attention


def gqa_session(tree: bool) -> ort.InferenceSession:
    inputs = ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total_len", "cos", "sin"] + (["positions", "bias"] if tree else [])
    node = helper.make_node("GroupQueryAttention", inputs, ["out", "present_key", "present_value"], domain="com.microsoft",
                            num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1, scale=HEAD_DIM ** -0.5)
    cache = ["B", KV_HEADS, "L", HEAD_DIM]
    specs = [("qkv", TensorProto.FLOAT, ["B", "S", (HEADS + 2 * KV_HEADS) * HEAD_DIM]), ("past_key", TensorProto.FLOAT, cache),
             ("past_value", TensorProto.FLOAT, cache), ("seqlens_k", TensorProto.INT32, ["B"]),
             ("total_len", TensorProto.INT32, []), ("cos", TensorProto.FLOAT, [MAX_POSITIONS, HEAD_DIM // 2]),
             ("sin", TensorProto.FLOAT, [MAX_POSITIONS, HEAD_DIM // 2])]
    if tree:
        specs += [("positions", TensorProto.INT64, ["B", "S"]), ("bias", TensorProto.FLOAT, ["B", 1, "S", "T"])]
    graph = helper.make_graph(
        [node], "gqa", [helper.make_tensor_value_info(*spec) for spec in specs],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "S", HEADS * HEAD_DIM]),
         helper.make_tensor_value_info("present_key", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("present_value", TensorProto.FLOAT, cache)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options)


def rotary_tables() -> tuple[np.ndarray, np.ndarray]:
    inv_freq = 1.0 / (100000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    angles = np.arange(MAX_POSITIONS)[:, None] * inv_freq[None]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def bind_in_place(session, keys, values, feeds):
    """Bind the cache buffers as both past and present: the kernel writes the new K/V into them."""
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    for name, array in (("past_key", keys), ("past_value", values)):
        binding.bind_input(name, "cpu", 0, np.float32, list(array.shape), array.ctypes.data)
    binding.bind_output("out", "cpu")
    for name, array in (("present_key", keys), ("present_value", values)):
        binding.bind_output(name, "cpu", 0, np.float32, list(array.shape), array.ctypes.data)
    return binding


def run_in_place(session, keys, values, feeds) -> np.ndarray:
    binding = bind_in_place(session, keys, values, feeds)
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0]


def reference(qkv, old_keys, old_values, past, positions, allowed, cos, sin):
    """numpy attention of one row: rotary (half rotation) at `positions`, GQA over past + new, `allowed` [S, past+S]."""
    def rotate(x, position):
        half = HEAD_DIM // 2
        c, s = cos[position], sin[position]
        return np.concatenate([x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s], -1)

    steps = qkv.shape[0]
    q = qkv[:, :HEADS * HEAD_DIM].reshape(steps, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].reshape(steps, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].reshape(steps, KV_HEADS, HEAD_DIM)
    q = np.stack([rotate(q[t], positions[t]) for t in range(steps)])
    k = np.stack([rotate(k[t], positions[t]) for t in range(steps)])
    keys = np.concatenate([old_keys[:, :past], k.transpose(1, 0, 2)], 1)
    values = np.concatenate([old_values[:, :past], v.transpose(1, 0, 2)], 1)
    out = np.zeros((steps, HEADS * HEAD_DIM), np.float32)
    for t in range(steps):
        for head in range(HEADS):
            group = head // (HEADS // KV_HEADS)
            scores = keys[group] @ q[t, head] * HEAD_DIM ** -0.5
            scores[~allowed[t]] = -np.inf
            weights = np.exp(scores - scores.max())
            out[t, head * HEAD_DIM:(head + 1) * HEAD_DIM] = weights / weights.sum() @ values[group]
    return out, k


def check_decode(cos, sin, rng) -> float:
    past = np.array([37, 120], np.int32)  # two rows, different cached lengths
    keys = rng.standard_normal((2, KV_HEADS, 256, HEAD_DIM)).astype(np.float32)
    values = rng.standard_normal(keys.shape).astype(np.float32)
    old_keys, old_values = keys.copy(), values.copy()
    qkv = rng.standard_normal((2, 1, (HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    out = run_in_place(gqa_session(tree=False), keys, values, {
        "qkv": qkv, "seqlens_k": past, "total_len": np.array(past.max() + 1, np.int32), "cos": cos, "sin": sin})
    error = 0.0
    for row, p in enumerate(past):
        allowed = np.ones((1, p + 1), bool)
        expected, new_k = reference(qkv[row], old_keys[row], old_values[row], p, [p], allowed, cos, sin)
        error = max(error, np.abs(out[row] - expected).max())
        assert np.allclose(keys[row, :, p], new_k[0], atol=1e-5), "new key not written in place at the row's position"
        untouched = np.ones(keys.shape[2], bool)
        untouched[p] = False
        assert np.array_equal(keys[row][:, untouched], old_keys[row][:, untouched]), "other cache positions changed"
    return error


def check_tree(cos, sin, rng) -> float:
    past, steps = 10, 3  # a root and two sibling children: both children at depth 1, child 2 must not see child 1
    keys = rng.standard_normal((1, KV_HEADS, 64, HEAD_DIM)).astype(np.float32)
    values = rng.standard_normal(keys.shape).astype(np.float32)
    old_keys, old_values = keys.copy(), values.copy()
    qkv = rng.standard_normal((1, steps, (HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    positions = np.array([[past, past + 1, past + 1]], np.int64)
    bias = np.zeros((1, 1, steps, past + steps), np.float32)
    bias[0, 0, 2, past + 1] = -np.inf
    out = run_in_place(gqa_session(tree=True), keys, values, {
        "qkv": qkv, "seqlens_k": np.array([past + steps - 1], np.int32), "total_len": np.array(past + steps, np.int32),
        "cos": cos, "sin": sin, "positions": positions, "bias": bias})
    allowed = np.tril(np.ones((steps, past + steps), bool), k=past) & np.isfinite(bias[0, 0])
    expected, new_k = reference(qkv[0], old_keys[0], old_values[0], past, positions[0], allowed, cos, sin)
    assert np.allclose(keys[0, :, past:past + steps].transpose(1, 0, 2), new_k, atol=1e-5), "tree keys not in place"
    return float(np.abs(out[0] - expected).max())


def time_decode_node(cos, sin, rng, runs: int = 2000) -> float:
    keys = np.zeros((1, KV_HEADS, 768, HEAD_DIM), np.float32)
    values = np.zeros_like(keys)
    session = gqa_session(tree=False)
    feeds = {"qkv": rng.standard_normal((1, 1, (HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32),
             "seqlens_k": np.array([100], np.int32), "total_len": np.array(101, np.int32), "cos": cos, "sin": sin}
    binding = bind_in_place(session, keys, values, feeds)  # bound once, as a runner would per step shape
    for _ in range(50):
        session.run_with_iobinding(binding)
    start = time.perf_counter()
    for _ in range(runs):
        session.run_with_iobinding(binding)
    return (time.perf_counter() - start) / runs * 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    cos, sin = rotary_tables()
    print(f"onnxruntime {ort.__version__}")
    try:
        print(f"decode, 2 rows with 37 and 120 cached positions, cache bound in place: max |out - numpy| = "
              f"{check_decode(cos, sin, rng):.2e}")
        print(f"tree verify, depth positions + tree mask: max |out - numpy| = {check_tree(cos, sin, rng):.2e}")
    except AssertionError as err:
        sys.exit(f"FAILED: {err}")
    print(f"one node, batch 1, 100 of 768 cache positions, 2 threads: {time_decode_node(cos, sin, rng):.1f} us per run "
          "(session overhead included; our attention is ~25 nodes per layer)")


if __name__ == "__main__":
    main()
