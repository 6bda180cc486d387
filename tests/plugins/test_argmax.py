"""ArgMax, our onnxruntime CPU kernel for the step graph's greedy token: the first position of each row's largest
value, as numpy's argmax and onnxruntime's ArgMax give it, on every clone the CPU runs; which nodes it replaces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plugins import argmax, native_ops
from plugins.native_ops import DOMAIN

pytestmark = pytest.mark.skipif(
    native_ops.unavailable_reason() is not None,
    reason=f"our kernels cannot be built here: {native_ops.unavailable_reason()}",
)


def argmax_model(shape: tuple[int, ...], domain: str = DOMAIN, **attributes):
    from onnx import TensorProto, helper

    node = helper.make_node("ArgMax", ["x"], ["y"], domain=domain, **attributes)
    graph = helper.make_graph(
        [node],
        "argmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])


def run(library: Path, model, x: np.ndarray, threads: int = 2) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(library))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def ours(library: Path, x: np.ndarray, threads: int = 2) -> np.ndarray:
    return run(library, argmax_model(x.shape), x, threads)


# widths around the kernel's 16-lane vectors and its 4 x 16 strides, and the default model's vocabulary
WIDTHS = [1, 2, 15, 16, 17, 63, 64, 65, 100, 1000, 49152]


@pytest.fixture(scope="module")
def baseline_library(tmp_path_factory) -> Path:
    """The library with the x86-64 baseline clone of the kernel's loop only (16 lanes in SSE registers)."""
    target = tmp_path_factory.mktemp("baseline_clone") / native_ops.LIBRARY_NAME
    return native_ops._compile(target, ('-DARGMAX_CLONES="default"',))


@pytest.mark.parametrize("width", WIDTHS)
def test_the_first_position_of_the_largest_value_as_numpy_finds_it(library, baseline_library, width):
    """On the clone this CPU runs (x86-64-v4 or -v3) and on the baseline one."""
    x = np.random.default_rng(width).standard_normal((3, 4, width)).astype(np.float32)
    assert np.array_equal(ours(library, x), x.argmax(-1))
    assert np.array_equal(ours(baseline_library, x), x.argmax(-1))


@pytest.mark.parametrize("width", WIDTHS)
def test_ties_go_to_the_first_position_whichever_lane_or_stride_holds_it(library, width):
    rng = np.random.default_rng(width + 1)
    rows = []
    for first in sorted({0, width // 3, width - 1}):
        row = rng.standard_normal(width).astype(np.float32)
        top = np.float32(row.max() + 1)
        row[first] = top
        for later in (first + 1, first + 16, first + 17, first + 64, width - 1):  # same lane, next lane, next stride
            if first < later < width:
                row[later] = top
        rows.append(row)
    x = np.stack(rows)
    assert np.array_equal(ours(library, x), x.argmax(-1))
    assert np.array_equal(ours(library, x), run(library, argmax_model(x.shape, "", axis=-1, keepdims=0), x))


def test_a_row_of_equal_values_gives_its_first_position_and_infinities_count(library):
    x = np.full((4, 70), -np.inf, np.float32)
    x[1, 69] = np.inf
    x[2] = 3.0
    x[3, 5], x[3, 66] = -1e30, np.inf
    assert ours(library, x).tolist() == [0, 69, 0, 66]


def test_a_nan_is_never_the_largest_value(library):
    x = np.zeros((3, 40), np.float32)
    x[0, 0], x[0, 3] = np.nan, 1.0  # a NaN first, in the vector part
    x[1, 20], x[1, 39] = 2.0, np.nan  # in the tail
    x[2] = np.nan
    assert ours(library, x).tolist() == [3, 20, 0]


def test_rows_split_over_threads_answer_as_one_thread_does(library):
    x = np.random.default_rng(3).standard_normal((2, 9, 3000)).astype(np.float32)
    assert np.array_equal(ours(library, x, threads=2), ours(library, x, threads=1))
    one = x[:1, :1]
    assert ours(library, one).shape == (1, 1) and ours(library, x[0, 0]).shape == ()


def test_it_replaces_only_the_argmax_it_computes(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    def node(name, source, **attributes):
        return helper.make_node("ArgMax", [source], [name], name=name, **attributes)

    nodes = [
        node("last", "x", axis=-1, keepdims=0),
        node("kept_dims", "x", axis=-1, keepdims=1),
        node("first_axis", "x", axis=0, keepdims=0),
        node("last_index", "x", axis=-1, keepdims=0, select_last_index=1),
        node("integers", "ids", axis=-1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5]),
        ],
        [helper.make_tensor_value_info(n.output[0], TensorProto.INT64, None) for n in nodes],
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    assert argmax.use_in_graph(path) == 1
    rewritten = {n.name: n.domain for n in onnx.load(str(path)).graph.node}
    assert rewritten == {"last": DOMAIN, "kept_dims": "", "first_axis": "", "last_index": "", "integers": ""}


def test_an_engine_takes_it_for_the_step_graphs_greedy_token(engine_factory):
    import onnx

    from runner import LLM

    llm = LLM(str(engine_factory("gqa", quant="int4")))
    step = llm.engine.manifest.graphs["step"]
    assert "ArgMax" in step.native_ops
    graph = onnx.load(str(llm.engine.artifact.path(step.file)), load_external_data=False)
    assert [n.domain for n in graph.graph.node if n.op_type == "ArgMax"] == [DOMAIN]
