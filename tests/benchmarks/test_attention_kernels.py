import numpy as np
import pytest
from click.testing import CliRunner

from benchmarks import attention_kernels
from plugins import native_ops

pytestmark = pytest.mark.skipif(
    native_ops.unavailable_reason() is not None,
    reason=f"our kernels cannot be built here: {native_ops.unavailable_reason()}",
)


@pytest.mark.parametrize("cache", ["float", "int8"])
def test_both_kernels_compute_the_same_attention_from_the_same_step(tmp_path, monkeypatch, cache):
    """The benchmark times like against like: onnxruntime's node and ours get the same inputs and caches and give
    the same outputs (an int8 cache to its rounding: onnxruntime multiplies by 1 / scale)."""
    monkeypatch.setattr(attention_kernels, "LAYERS", 2)
    library = native_ops.compile_library(tmp_path)
    outputs = {}
    for kernel in ("onnxruntime", "ours"):
        session, binding, _caches = attention_kernels.step_session(
            kernel, cache == "int8", (2, 3, 20), library, 1, tmp_path
        )
        session.run_with_iobinding(binding)
        outputs[kernel] = [value.numpy() for value in binding.get_outputs()[-2:]]  # the layers' attention outputs
    for theirs, ours in zip(outputs["onnxruntime"], outputs["ours"]):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5 if cache == "float" else 2e-2)


def test_it_prints_a_line_per_shape_with_every_kernel(monkeypatch):
    monkeypatch.setattr(attention_kernels, "LAYERS", 2)
    result = CliRunner().invoke(
        attention_kernels.main, ["--shapes", "1x1x30,2x4x10", "--rounds", "4", "--threads", "1"]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[1].startswith("rows 1 tokens 1 cached 30:") and lines[2].startswith("rows 2 tokens 4 cached 10:")
    assert all(line.count("|") == 3 and "ours int8" in line for line in lines[1:])
