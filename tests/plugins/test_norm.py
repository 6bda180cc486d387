"""The residual add + RMSNorm plugin: its reference against the com.microsoft::SkipSimplifiedLayerNormalization node
it is lowered to, and against transformers' RMSNorm; our SkipRmsNorm kernel against both, and which nodes it
replaces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from plugins import native_ops
from plugins.native_ops import DOMAIN
from plugins.norm import add_rms_norm, add_then_rms_norm, onnx_translations, rms_norm, use_in_graph


class AddNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x, residual):
        return add_rms_norm(x, residual, self.weight, 1e-5)


def test_onnx_lowering_is_one_fused_node_giving_the_norm_and_the_sum(tmp_path):
    import onnx
    import onnxruntime as ort

    generator = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 3, 40, generator=generator), torch.randn(2, 3, 40, generator=generator) * 4
    module = AddNorm(torch.rand(40, generator=generator) + 0.5).eval()
    path = tmp_path / "norm.onnx"
    torch.onnx.export(module, (x, residual), str(path), dynamo=True, custom_translation_table=onnx_translations())
    assert [n.op_type for n in onnx.load(str(path)).graph.node] == ["SkipSimplifiedLayerNormalization"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    normed, total = session.run(None, dict(zip([i.name for i in session.get_inputs()], (x.numpy(), residual.numpy()))))
    ref_normed, ref_total = module(x, residual)
    np.testing.assert_allclose(total, ref_total.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(normed, ref_normed.numpy(), rtol=0, atol=1e-5)


def test_reference_is_transformers_rms_norm_of_the_sum():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, residual = torch.randn(4, 64), torch.randn(4, 64)
    hf = LlamaRMSNorm(64, eps=1e-6)
    hf.weight.data.uniform_(0.5, 1.5)
    normed, total = add_rms_norm(x, residual, hf.weight.data, 1e-6)
    torch.testing.assert_close(total, x + residual)
    torch.testing.assert_close(normed, hf(x + residual))
    torch.testing.assert_close(rms_norm(x, hf.weight.data, 1e-6), hf(x))


needs_compiler = pytest.mark.skipif(
    native_ops.unavailable_reason() is not None,
    reason=f"our kernels cannot be built here: {native_ops.unavailable_reason()}",
)


def skip_norm_model(shape: tuple[int, ...], epsilon: float = 1e-5, domain: str = DOMAIN):
    """One SkipRmsNorm (our domain) or SkipSimplifiedLayerNormalization (com.microsoft) node over [..., H] rows."""
    from onnx import TensorProto, helper

    width = shape[-1]
    if domain == DOMAIN:
        node = helper.make_node("SkipRmsNorm", ["x", "skip", "gamma"], ["y", "sum"], domain=DOMAIN, epsilon=epsilon)
    else:
        outputs = ["y", "", "", "sum"]
        node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], outputs, domain=domain)
        node.attribute.append(helper.make_attribute("epsilon", epsilon))
    graph = helper.make_graph(
        [node],
        "norm",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("skip", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("gamma", TensorProto.FLOAT, [width]),
        ],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", "sum")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def run_norm(library: Path, x, skip, gamma, threads: int = 2, domain: str = DOMAIN):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(library))
    model = skip_norm_model(x.shape, domain=domain)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x, "skip": skip, "gamma": gamma})


def norm_inputs(shape: tuple[int, ...], seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32)
    skip = (rng.standard_normal(shape, dtype=np.float32) * 4).astype(np.float32)
    return x, skip, (rng.random(shape[-1], dtype=np.float32) + 0.5).astype(np.float32)


# a decode step (one row), a verify tree, rows past what one thread runs alone (576 x 29 values), widths with a tail
# after the 16-lane vectors, 2 to 4 dimensions
NORM_SHAPES = [(1, 1, 576), (1, 6, 576), (3, 29, 576), (40, 576), (2, 5, 40), (1, 2, 3, 17), (4, 7), (64,)]


@pytest.fixture(scope="module")
def baseline_norm_library(tmp_path_factory) -> Path:
    """The library with the x86-64 baseline clone of the norm's loop only (16 lanes in SSE registers)."""
    if reason := native_ops.unavailable_reason():
        pytest.skip(f"our kernels cannot be built here: {reason}")
    target = tmp_path_factory.mktemp("baseline_norm") / native_ops.LIBRARY_NAME
    return native_ops._compile(target, ('-DNORM_CLONES="default"',))


@needs_compiler
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_our_kernel_computes_the_reference_and_onnxruntimes_node(library, baseline_norm_library, shape):
    """The sum exactly, the norm to float rounding, against the op's float64 reference and onnxruntime's kernel
    (which takes 2 or 3 dimensions only); the baseline clone gives the same bits as the clone this CPU runs."""
    x, skip, gamma = norm_inputs(shape)
    normed, total = run_norm(library, x, skip, gamma)
    ref_normed, ref_total = add_then_rms_norm(*(torch.from_numpy(a).double() for a in (x, skip, gamma)), 1e-5)
    assert np.array_equal(total, x + skip)
    np.testing.assert_allclose(normed, ref_normed.numpy(), rtol=2e-6, atol=2e-6)
    if len(shape) in (2, 3):  # what onnxruntime's kernel takes
        theirs, their_total = run_norm(library, x, skip, gamma, domain="com.microsoft")
        assert np.array_equal(total, their_total)
        np.testing.assert_allclose(normed, theirs, rtol=2e-6, atol=2e-6)
    baseline = run_norm(baseline_norm_library, x, skip, gamma)
    assert all(np.array_equal(a, b) for a, b in zip(baseline, (normed, total)))


@needs_compiler
def test_a_rows_result_does_not_depend_on_the_call_around_it(library):
    """Alone, beside a few rows (run on the calling thread), among many (split over the threads): the same bits, as
    batch invariance and exact speculation need."""
    x, skip, gamma = norm_inputs((64, 576), seed=1)
    many = run_norm(library, x, skip, gamma)[0]
    few = run_norm(library, x[:6], skip[:6], gamma)[0]
    one_thread = run_norm(library, x, skip, gamma, threads=1)[0]
    for row in (0, 5, 63):
        alone = run_norm(library, x[row : row + 1], skip[row : row + 1], gamma)[0]
        assert np.array_equal(alone[0], many[row]) and np.array_equal(alone[0], one_thread[row])
    assert np.array_equal(few, many[:6])


@needs_compiler
def test_inputs_of_different_shapes_get_a_clear_error(library):
    import onnxruntime as ort

    x, skip, gamma = norm_inputs((2, 16))
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    session = ort.InferenceSession(
        skip_norm_model(("rows", "width")).SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    with pytest.raises(Exception, match="SkipRmsNorm: input and skip must have one shape"):
        session.run(None, {"x": x, "skip": skip[:1], "gamma": gamma})
    with pytest.raises(Exception, match="SkipRmsNorm: input and skip must have one shape"):
        session.run(None, {"x": x, "skip": skip, "gamma": gamma[:8]})


def test_it_replaces_only_the_norms_it_computes(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    def node(name, inputs, outputs, **attributes):
        return helper.make_node(
            "SkipSimplifiedLayerNormalization", inputs, outputs, name=name, domain="com.microsoft", **attributes
        )

    nodes = [
        node("plain", ["x", "s", "g"], ["y1", "", "", "sum1"], epsilon=1e-6),
        node("no_sum", ["x", "s", "g"], ["y2"], epsilon=1e-6),
        node("with_bias", ["x", "s", "g", "b"], ["y3", "", "", "sum3"], epsilon=1e-6),
        node("its_deviation_used", ["x", "s", "g"], ["y4", "", "inverse", "sum4"], epsilon=1e-6),
        node("default_epsilon", ["x", "s", "g"], ["y5"]),
        node("half", ["h", "h", "gh"], ["y6"], epsilon=1e-6),
    ]
    values = [("x", TensorProto.FLOAT), ("s", TensorProto.FLOAT), ("h", TensorProto.FLOAT16)]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(name, kind, [2, 8]) for name, kind in values],
        [helper.make_tensor_value_info(n.output[0], TensorProto.UNDEFINED, None) for n in nodes],
        [
            helper.make_tensor("g", TensorProto.FLOAT, [8], [1.0] * 8),
            helper.make_tensor("b", TensorProto.FLOAT, [8], [0.0] * 8),
            helper.make_tensor("gh", TensorProto.FLOAT16, [8], [1.0] * 8),
        ],
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    assert use_in_graph(path) == 2
    rewritten = {n.name: (n.op_type, list(n.output)) for n in onnx.load(str(path)).graph.node}
    assert rewritten["plain"] == ("SkipRmsNorm", ["y1", "sum1"])
    assert rewritten["no_sum"] == ("SkipRmsNorm", ["y2", "y2.unused_sum"])
    kept = {name for name, (op, _) in rewritten.items() if op == "SkipSimplifiedLayerNormalization"}
    assert kept == {"with_bias", "its_deviation_used", "default_epsilon", "half"}


@needs_compiler
def test_an_engine_runs_its_norms_on_our_kernel(engine_factory):
    import onnx

    from runner import LLM
    from runner.tools.info import describe

    llm = LLM(str(engine_factory("gqa", quant="int4")))
    step = llm.engine.manifest.graphs["step"]
    assert "SkipRmsNorm" in step.native_ops
    ops = [n.op_type for n in onnx.load(str(llm.engine.artifact.path(step.file)), load_external_data=False).graph.node]
    assert "SkipSimplifiedLayerNormalization" not in ops and ops.count("SkipRmsNorm") > 0
    kernels = next(line for line in describe(llm.engine.artifact) if line.startswith("kernels:"))
    assert "our SkipRmsNorm" in kernels
