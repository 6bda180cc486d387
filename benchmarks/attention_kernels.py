"""Time the step graph's attention alone: onnxruntime's GroupQueryAttention against our DecodeAttention, over a float
and an int8 KV cache, for decode steps, verify trees and prompt chunks (the default model's shape).

    python benchmarks/attention_kernels.py [--shapes 1x1x700,8x1x700,1x6x700,1x128x512] [--rounds 15] [--threads 2]

A shape is ROWSxTOKENSxCACHED: rows of the call, new tokens a row, positions already cached. Each graph holds one
attention node per layer, each with its own cache buffers bound in place (as the runner binds them), so one call is
a step's attention; between calls a buffer of a step's weights' size is streamed, so the caches come from memory as
in an engine. The four graphs of a shape run in turn within each round; medians over the rounds after the first
three. Absolute times include the harness's own cost (cold pages, the outputs allocated a call): compare within a
line.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import click
import numpy as np

from plugins import native_ops

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
WEIGHTS_BYTES = 96 * 2**20  # about what a decode step of the default int4 engine streams
KERNELS = [("onnxruntime", "float"), ("ours", "float"), ("onnxruntime", "int8"), ("ours", "int8")]
STEP_INPUTS = ["qkv", "seqlens_k", "total_len", "cos", "sin", "position_ids", "bias", "query_lens"]


def step_inputs(rows: int, tokens: int, cached: int, length: int, int8: bool) -> dict[str, np.ndarray]:
    """The inputs every layer's node shares: new tokens' projections, positions, rotary tables, an empty bias."""
    rng = np.random.default_rng(0)
    angles = np.arange(length)[:, None] * (1.0 / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))[None]
    inputs = {
        "qkv": rng.standard_normal((rows, tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM), dtype=np.float32),
        "seqlens_k": np.full(rows, cached + tokens - 1, np.int32),
        "total_len": np.array(cached + tokens, np.int32),
        "cos": np.cos(angles).astype(np.float32),
        "sin": np.sin(angles).astype(np.float32),
        "position_ids": np.tile(cached + np.arange(tokens), (rows, 1)).astype(np.int64),
        "bias": np.zeros((rows, 1, tokens, cached + tokens), np.float32),
        "query_lens": np.full(rows, tokens, np.int32),
    }
    if int8:
        inputs["k_scale"] = inputs["v_scale"] = np.full((1, KV_HEADS, 1, HEAD_DIM), 0.02, np.float32)
    return inputs


def attention_node(kernel: str, int8: bool, layer: int):
    from onnx import helper

    past = [f"past_key{layer}", f"past_value{layer}"]
    outputs = [f"out{layer}", f"present_key{layer}", f"present_value{layer}"]
    scales = ["k_scale", "v_scale"] if int8 else ["", ""]
    if kernel == "ours":
        names = ["qkv", *past, *STEP_INPUTS[1:], *(scales if int8 else [])]
        op = "DecodeAttentionInt8Cache" if int8 else "DecodeAttention"
        return helper.make_node(
            op, names, outputs, domain=native_ops.DOMAIN, num_heads=HEADS, kv_num_heads=KV_HEADS, scale=HEAD_DIM**-0.5
        )
    names = ["qkv", "", "", *past, *STEP_INPUTS[1:-1], "", *scales, "", "", "query_lens"]
    cache = dict(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8) if int8 else {}
    return helper.make_node(
        "GroupQueryAttention",
        names,
        outputs,
        domain="com.microsoft",
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        scale=HEAD_DIM**-0.5,
        do_rotary=1,
        rotary_interleaved=0,
        **cache,
    )


def step_session(kernel: str, int8: bool, shape: tuple[int, int, int], library: Path, threads: int, work: Path):
    """(session, binding) of one shape's graph: LAYERS nodes, their caches bound in place."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rows, tokens, cached = shape
    length = cached + tokens + 64
    inputs = step_inputs(rows, tokens, cached, length, int8)
    rng = np.random.default_rng(1)
    caches = {}
    buffer = (rows, KV_HEADS, length, HEAD_DIM)
    for layer in range(LAYERS):
        for name in (f"past_key{layer}", f"past_value{layer}"):
            caches[name] = (
                rng.integers(-127, 128, buffer).astype(np.int8) if int8 else rng.standard_normal(buffer, np.float32)
            )
    types = {np.float32: TensorProto.FLOAT, np.int8: TensorProto.INT8, np.int32: TensorProto.INT32}
    types[np.int64] = TensorProto.INT64
    cache_type = TensorProto.INT8 if int8 else TensorProto.FLOAT
    graph = helper.make_graph(
        [attention_node(kernel, int8, layer) for layer in range(LAYERS)],
        "attention",
        [helper.make_tensor_value_info(n, types[v.dtype.type], v.shape) for n, v in {**inputs, **caches}.items()],
        [
            helper.make_tensor_value_info(f"{name}{layer}", TensorProto.FLOAT if name == "out" else cache_type, None)
            for layer in range(LAYERS)
            for name in ("out", "present_key", "present_value")
        ],
    )
    opsets = [helper.make_opsetid(d, v) for d, v in (("", 17), ("com.microsoft", 1), (native_ops.DOMAIN, 1))]
    path = work / f"{kernel}_{'int8' if int8 else 'float'}_{'x'.join(map(str, shape))}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(library))
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    for name, value in inputs.items():
        binding.bind_cpu_input(name, value)
    for name, buffer in caches.items():
        binding.bind_input(name, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
        present = name.replace("past", "present")
        binding.bind_output(present, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
    for layer in range(LAYERS):
        binding.bind_output(f"out{layer}", "cpu")
    return session, binding, caches  # the caches must outlive the binding


@click.command()
@click.option("--shapes", default="1x1x700,8x1x700,1x6x700,1x1x2000,1x37x0,1x128x512", show_default=True)
@click.option("--rounds", default=15, show_default=True)
@click.option("--threads", default=2, show_default=True)
def main(shapes: str, rounds: int, threads: int) -> None:
    reason = native_ops.unavailable_reason()
    if reason:
        raise click.ClickException(f"our kernels cannot be built here: {reason}")
    work = Path(tempfile.mkdtemp(prefix="attention-kernels-"))
    library = native_ops.compile_library(work)
    cases = [tuple(int(n) for n in shape.split("x")) for shape in shapes.split(",")]
    sessions = {
        (case, kernel): step_session(kernel[0], kernel[1] == "int8", case, library, threads, work)
        for case in cases
        for kernel in KERNELS
    }
    weights = np.ones(WEIGHTS_BYTES // 4, np.float32)
    times: dict = {key: [] for key in sessions}
    for _ in range(rounds):
        for key, (session, binding, _caches) in sessions.items():
            weights += 1.0  # a step's weights stream through the caches
            start = time.perf_counter()
            session.run_with_iobinding(binding)
            times[key].append(time.perf_counter() - start)
    print(f"{LAYERS} layers of {HEADS} / {KV_HEADS} heads of {HEAD_DIM}, {threads} threads, ms per call (median)")
    for case in cases:
        cells = [f"{k} {c} {np.median(times[(case, (k, c))][3:]) * 1e3:7.2f}" for k, c in KERNELS]
        print(f"rows {case[0]} tokens {case[1]} cached {case[2]}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
