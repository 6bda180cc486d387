"""The exported step graph's own structure (its numbers are checked against transformers in test_engine_parity)."""

from __future__ import annotations

import onnx

from builder.export import GRAPH_FILE


def test_fused_norms_name_only_the_outputs_that_are_read(engine_factory):
    # the export as it is, before our kernels take over its nodes (plugins/norm.py keeps the outputs it names)
    engine = engine_factory("gqa", native_decode_attention=False, native_quantized_matmul=False)
    graph = onnx.load(str(engine / GRAPH_FILE), load_external_data=False).graph
    read = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
    norms = [node for node in graph.node if node.op_type == "SkipSimplifiedLayerNormalization"]
    assert norms
    for node in norms:
        output, mean, inv_std, total = node.output
        assert (mean, inv_std) == ("", "")  # statistics nothing reads: the kernel need not write them
        assert output in read
        assert total == "" or total in read  # the running sum feeds the next layer, except after the last one
    assert sum(node.output[3] != "" for node in norms) == len(norms) - 1
