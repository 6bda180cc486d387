"""benchmarks/quantized_rows.py on tiny shapes: every kind of node runs for every row count, and the sessions it times
compute what the kernel computes for those weights (the same node as the kernel tests build)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import quantized_rows
from engines.backends.onnxruntime import kernel_library_tiles
from plugins import native_ops

pytestmark = pytest.mark.skipif(native_ops.unavailable_reason() is not None, reason="our kernels cannot be built here")


def test_every_kind_and_row_count_is_timed(tmp_path, monkeypatch):
    monkeypatch.setattr(quantized_rows, "SHAPES", [("tiny", 40, 96)])
    monkeypatch.setattr(quantized_rows, "ROWS", [1, 3])
    library = native_ops.compile_library(tmp_path)
    choices = quantized_rows.tile_choices(library)
    assert choices[-1] == "avx2" and kernel_library_tiles(library) in ("avx2", "avx512vnni")
    results = quantized_rows.measure(library, threads=1, repeats=5, tile_kinds=choices)
    assert set(results) == set(choices)
    for on_tiles in results.values():
        assert set(on_tiles) == {f"{kind} tiny 40x96" for kind in quantized_rows.KINDS}
        assert all(set(times) == {1, 3} and min(times.values()) > 0 for times in on_tiles.values())


def test_its_q4_1_session_applies_the_minimums(tmp_path):
    library = native_ops.compile_library(tmp_path)
    a = np.ones((1, 96), np.float32)
    with_minimums = quantized_rows.session(library, "Q4_1", 40, 96, 1).run(None, {"a": a})[0]
    without = quantized_rows.session(library, "Q4_0", 40, 96, 1).run(None, {"a": a})[0]
    assert with_minimums.shape == without.shape == (1, 40) and not np.allclose(with_minimums, without)
