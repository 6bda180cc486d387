"""The TensorRT backend's ONNX (builder/tensorrt.py), checked without TensorRT: onnx's checker, only standard ops
besides the plugin nodes, the plugin attributes TensorRT's parser looks up, and onnxruntime running the float
graph against the model it was exported from. The engine build itself needs TensorRT and a GPU."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
import torch

from builder.export import example_inputs
from builder.loaders import load_checkpoint
from builder.tensorrt import export_tensorrt_onnx, profile_shapes, unavailable_reason
from builder.weights import load_model
from engines.format import open_artifact
from plugins import tensorrt_plugin
from plugins.quant_linear import QuantSpec


def load(checkpoint, quant=None):
    config = load_checkpoint(str(checkpoint))
    return load_model(config.config, config.read_tensors(), torch.float32, quant, True, {}, 300, embedding_quant=quant)


def test_float_graph_is_standard_onnx_and_matches_the_model_in_onnxruntime(tmp_path, checkpoint_factory):
    import onnxruntime as ort

    model = load(checkpoint_factory("gqa"))
    spec = export_tensorrt_onnx(model, tmp_path, 256)
    path = tmp_path / spec.file
    onnx.checker.check_model(str(path))
    graph = onnx.load(str(path), load_external_data=False).graph
    assert {node.domain for node in graph.node} <= {"", "ai.onnx"}
    args = example_inputs(model)
    arrays = [a.numpy() for a in args[:6]] + [t.numpy() for t in args[6] + args[7]]
    feeds = dict(zip([t.name for t in spec.inputs], arrays))
    feeds["input_ids"] = np.array([[5, 9, 2], [7, 1, 4]])
    feeds["query_lens"] = np.array([3, 2])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], feeds)[0]
    layers = model.config.num_layers
    cache = [
        [torch.from_numpy(feeds[f"{kind}.{i}"]).clone() for i in range(layers)] for kind in ("past_key", "past_value")
    ]
    with torch.no_grad():
        expected = model(*(torch.from_numpy(feeds[name]) for name in list(feeds)[:6]), *cache)[0]
    np.testing.assert_allclose(logits, expected.numpy(), rtol=0, atol=1e-4)


def test_int4_linears_are_plugin_nodes_tensorrt_finds_by_name(tmp_path, checkpoint_factory):
    spec = export_tensorrt_onnx(load(checkpoint_factory("gqa"), QuantSpec(4, 32, 0)), tmp_path, 256)
    onnx.checker.check_model(str(tmp_path / spec.file))
    graph = onnx.load(str(tmp_path / spec.file), load_external_data=False).graph
    ops = Counter((node.domain, node.op_type) for node in graph.node)
    assert not any(domain == "com.microsoft" for domain, _ in ops)
    plugin_nodes = [node for node in graph.node if node.op_type == tensorrt_plugin.OP]
    assert len(plugin_nodes) == 9  # 2 layers x (qkv, o, gate_up, down) + the LM head
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in plugin_nodes[0].attribute}
    assert attributes["plugin_namespace"] == tensorrt_plugin.NAMESPACE.encode()
    assert attributes["plugin_version"] == tensorrt_plugin.VERSION.encode()
    assert attributes["bits"] == 4 and attributes["block_size"] == 32


def test_q4_1_linears_take_the_plugin_with_minimums(tmp_path, checkpoint_factory):
    """A Q4_1 GGUF's blocks kept (its Q8_0 LM head takes the plugin without minimums)."""
    from builder.weights import kept_block_specs
    from tests.tiny_checkpoint import make_gguf

    checkpoint = load_checkpoint(str(make_gguf(tmp_path / "tiny.gguf", checkpoint_factory("gqa"))))
    quant = QuantSpec(4, 32, 0)
    kept = kept_block_specs(checkpoint.config, quant, True, checkpoint.block_formats)
    tensors = checkpoint.read_tensors(frozenset(checkpoint.block_formats))
    model = load_model(checkpoint.config, tensors, torch.float32, quant, True, kept, 300, embedding_quant=quant)
    spec = export_tensorrt_onnx(model, tmp_path, 256)
    graph = onnx.load(str(tmp_path / spec.file), load_external_data=False).graph
    nodes = Counter(node.op_type for node in graph.node if node.op_type.startswith(tensorrt_plugin.OP))
    assert nodes == {tensorrt_plugin.OP_WITH_MINIMUMS: 8, tensorrt_plugin.OP: 1}


def test_optimization_profiles_cover_every_input_of_each_phase(engine_factory):
    manifest = open_artifact(engine_factory("gqa")).manifest
    inputs = {t.name: t for t in manifest.graphs["step"].inputs}
    for phase in manifest.phases.values():
        shapes = profile_shapes(phase, manifest.model, manifest.max_seq_len)
        assert set(shapes) == set(inputs)
        for name, (low, opt, high) in shapes.items():
            assert len(low) == len(inputs[name].shape) and all(a <= b <= c for a, b, c in zip(low, opt, high))
            fixed = [(i, size) for i, size in enumerate(inputs[name].shape) if isinstance(size, int)]
            assert all(low[i] == high[i] == size for i, size in fixed), name
        assert shapes["input_ids"][2] == (max(phase.batch_sizes), max(phase.steps))


@pytest.mark.skipif(unavailable_reason() is None, reason="TensorRT is installed here")
def test_without_tensorrt_the_build_says_what_it_needs(checkpoint_factory, tmp_path):
    from builder.build import BuildOptions, build_engine

    with pytest.raises(ValueError, match="needs tensorrt and polygraphy"):
        build_engine(BuildOptions(str(checkpoint_factory("gqa")), tmp_path / "e", backend="tensorrt"))
