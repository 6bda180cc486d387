"""The onnxruntime backend's bound graphs: memory bound once, the rest given on every run."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from engines.backends.onnxruntime import BoundGraph


@pytest.fixture(scope="module")
def accumulate():
    """state += x; y = 2 * x: `state` is read and written in place, `x` and `y` change every run."""
    import onnxruntime as ort

    def value(name: str):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [4])

    graph = helper.make_graph(
        [helper.make_node("Add", ["state", "x"], ["new_state"]), helper.make_node("Add", ["x", "x"], ["y"])],
        "accumulate",
        [value("state"), value("x")],
        [value("new_state"), value("y")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_bound_memory_is_updated_in_place_and_per_run_arrays_are_written(accumulate):
    state = np.zeros(4, np.float32)
    bound = BoundGraph(accumulate, {"state": state, "new_state": state})
    for step in range(1, 4):
        y = np.empty(4, np.float32)
        bound.run({"x": np.full(4, step, np.float32)}, {"y": y})
        assert y.tolist() == [2.0 * step] * 4
    assert state.tolist() == [6.0] * 4


def test_every_unbound_input_and_output_must_be_given(accumulate):
    state = np.zeros(4, np.float32)
    bound = BoundGraph(accumulate, {"state": state, "new_state": state})
    with pytest.raises(ValueError, match="needs a value"):  # else the last run's x would be read again
        bound.run({}, {"y": np.empty(4, np.float32)})
    with pytest.raises(ValueError, match="needs an array"):
        bound.run({"x": np.ones(4, np.float32)}, {})


def test_the_quantized_matmul_tiles_are_the_kernel_librarys_choice(engine_factory, monkeypatch):
    from engines.backends.onnxruntime import quantized_matmul_tiles
    from engines.format import open_artifact
    from runner.core.machine import cpu_flags

    int4 = open_artifact(engine_factory("gqa", quant="int4"))
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= cpu_flags()
    assert quantized_matmul_tiles(int4) == ("avx512vnni" if vnni else "avx2")
    monkeypatch.setenv("LLM_ENGINE_BUILDER_KERNEL_ISA", "avx2")
    assert quantized_matmul_tiles(int4) == "avx2"
    assert quantized_matmul_tiles(open_artifact(engine_factory("gqa"))) is None  # fp32: no quantized matmul
