"""plugins/native_ops.py: the kernel library's compile cache, and the graph surgery that needs no compiler
(initializers stored anew in their weights file)."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from plugins import native_ops
from plugins.native_ops import rewrite_initializers

needs_compiler = pytest.mark.skipif(
    native_ops.unavailable_reason() is not None, reason=f"no kernel library here: {native_ops.unavailable_reason()}"
)


@pytest.fixture
def compiles(monkeypatch, tmp_path):
    """An empty kernel cache of this test's own, and the list of the compiler runs it makes."""
    monkeypatch.setenv("LLM_ENGINE_BUILDER_CACHE_DIR", str(tmp_path / "cache"))
    runs = []
    compile_now = native_ops._compile

    def counted(target):
        runs.append(target)
        return compile_now(target)

    monkeypatch.setattr(native_ops, "_compile", counted)
    return runs


@needs_compiler
def test_a_second_build_copies_the_library_the_first_compiled(compiles, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    assert native_ops.compile_library(first) == first / native_ops.LIBRARY_NAME
    assert native_ops.compile_library(second) == second / native_ops.LIBRARY_NAME
    assert len(compiles) == 1
    assert (first / native_ops.LIBRARY_NAME).read_bytes() == (second / native_ops.LIBRARY_NAME).read_bytes()
    assert sorted(p.name for p in second.iterdir()) == [native_ops.LIBRARY_NAME]
    entries = list((tmp_path / "cache" / "kernels").iterdir())
    assert len(entries) == 1 and [p.name for p in entries[0].iterdir()] == [native_ops.LIBRARY_NAME]


@needs_compiler
def test_an_edited_kernel_source_compiles_anew(compiles, tmp_path, monkeypatch):
    native_ops.compile_library(tmp_path)
    edited = tmp_path / "sources"
    edited.mkdir()
    sources = []
    for source in native_ops.SOURCES:
        shutil.copy(source, edited / source.name)
        sources.append(edited / source.name)
    shutil.copy(native_ops.ABI_HEADER, edited / native_ops.ABI_HEADER.name)
    with open(sources[0], "a") as appended:
        appended.write("/* edited */\n")
    monkeypatch.setattr(native_ops, "SOURCES", tuple(sources))
    native_ops.compile_library(tmp_path)
    assert len(compiles) == 2
    assert len(list((tmp_path / "cache" / "kernels").iterdir())) == 2


@needs_compiler
def test_without_a_writable_cache_the_library_is_compiled_into_the_artifact(compiles, tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("LLM_ENGINE_BUILDER_CACHE_DIR", str(blocked))
    out = tmp_path / "engine"
    out.mkdir()
    assert native_ops.compile_library(out) == out / native_ops.LIBRARY_NAME
    assert compiles == [out / native_ops.LIBRARY_NAME]
    assert sorted(p.name for p in out.iterdir()) == [native_ops.LIBRARY_NAME]


@needs_compiler
def test_a_failed_compile_says_why_and_caches_nothing(compiles, tmp_path, monkeypatch):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native_ops, "SOURCES", (broken,))
    with pytest.raises(ValueError, match="compiling our kernels failed"):
        native_ops.compile_library(tmp_path)
    assert not list((tmp_path / "cache" / "kernels").rglob(native_ops.LIBRARY_NAME))
    assert not (tmp_path / native_ops.LIBRARY_NAME).exists()


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
