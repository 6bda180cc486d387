"""plugins/native_ops.py's graph surgery that needs no compiler: initializers stored anew in their weights file."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from plugins.native_ops import rewrite_initializers


def graph_with_external_data(path) -> dict[str, np.ndarray]:
    arrays = {
        "first": np.arange(600, dtype=np.float32).reshape(20, 30),
        "scales": np.linspace(1e-3, 1, 512, dtype=np.float32),
        "last": np.arange(300, dtype=np.int64),
        "inline": np.array([0.5, 0.25], np.float32),
    }
    nodes = [helper.make_node("Identity", [name], [f"{name}_out"]) for name in arrays]
    graph = helper.make_graph(
        nodes,
        "g",
        [],
        [
            helper.make_tensor_value_info(f"{name}_out", helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for name, a in arrays.items()
        ],
        [numpy_helper.from_array(a, name) for name, a in arrays.items()],
    )
    onnx.save(
        helper.make_model(graph), str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=64
    )  # "inline" (8 bytes) stays in the graph file
    return arrays


def test_named_initializers_are_stored_as_converted_and_the_rest_as_they_were(tmp_path):
    path = tmp_path / "model.onnx"
    arrays = graph_with_external_data(path)
    size = (tmp_path / "model.onnx.data").stat().st_size
    converted = rewrite_initializers(
        path,
        dict.fromkeys(("scales", "inline", "last"), lambda a: None if a.dtype == np.int64 else a.astype(np.float16)),
    )
    assert converted == {"scales", "inline"}
    loaded = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    for name in ("scales", "inline"):
        assert loaded[name].dtype == np.float16
        np.testing.assert_array_equal(loaded[name], arrays[name].astype(np.float16))
    for name in ("first", "last"):
        np.testing.assert_array_equal(loaded[name], arrays[name])
    assert (tmp_path / "model.onnx.data").stat().st_size == size - 512 * 2
    assert not list(tmp_path.glob("*.rewriting"))
