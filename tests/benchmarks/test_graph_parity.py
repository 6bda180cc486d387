"""graph_parity on a tiny engine against a stand-in for an onnxruntime-genai model folder (the real ones come from
its model builder, which the tests do not install): the harness binds what genai_config.json names and times both."""

import json

import numpy as np
from onnx import TensorProto, helper, save

from benchmarks.graph_parity import PeerDecoder, graph_parity, parity_markdown

LAYERS, KV_HEADS, HEAD_SIZE, VOCAB = 2, 2, 4, 32


def stand_in_peer(folder):
    """A decoder with onnxruntime-genai's interface: logits from the token, each present = its past (one buffer)."""
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["logits"]),
        helper.make_node("ReduceSum", ["attention_mask"], ["mask_sum"], keepdims=0),
    ]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, "t"]),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "s", VOCAB]),
        helper.make_tensor_value_info("mask_sum", TensorProto.INT64, []),
    ]
    for layer in range(LAYERS):
        for kind in ("key", "value"):
            past, present = f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}"
            nodes.append(helper.make_node("Identity", [past], [present]))
            inputs.append(helper.make_tensor_value_info(past, TensorProto.FLOAT, [1, KV_HEADS, "m", HEAD_SIZE]))
            outputs.append(helper.make_tensor_value_info(present, TensorProto.FLOAT, [1, KV_HEADS, "m", HEAD_SIZE]))
    table = helper.make_tensor("table", TensorProto.FLOAT, [VOCAB, VOCAB], np.eye(VOCAB, dtype=np.float32).ravel())
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, initializer=[table])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "model.onnx"))
    decoder = {
        "filename": "model.onnx",
        "head_size": HEAD_SIZE,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "inputs": {
            "input_ids": "input_ids",
            "attention_mask": "attention_mask",
            "past_key_names": "past_key_values.%d.key",
            "past_value_names": "past_key_values.%d.value",
        },
        "outputs": {
            "logits": "logits",
            "present_key_names": "present.%d.key",
            "present_value_names": "present.%d.value",
        },
    }
    (folder / "genai_config.json").write_text(json.dumps({"model": {"decoder": decoder}}))
    return folder


def test_the_peer_decoder_binds_what_its_config_names_and_keeps_its_cache_in_place(tmp_path):
    peer = PeerDecoder(stand_in_peer(tmp_path), threads=1, max_len=8)
    before = [buffer.copy() for buffer in peer.cache]
    peer(5, 3)
    assert peer.vocab_size == VOCAB and len(peer.cache) == 2 * LAYERS
    for buffer, kept in zip(peer.cache, before):
        np.testing.assert_array_equal(buffer, kept)
        assert np.abs(buffer).sum() > 0  # filled: untouched zero pages would read faster than a real cache


def test_graph_parity_times_both_graphs_call_by_call(tmp_path, engine_factory):
    parity = graph_parity(engine_factory(), stand_in_peer(tmp_path), [5, 6, 7], threads=1, calls=20, span=4)
    assert parity.calls == 20 and parity.first_position == 3 and parity.span == 4
    assert parity.ours_ms > 0 and parity.peer_ms > 0 and parity.ours_over_peer > 0
    line = parity_markdown("ours", "peer", vars(parity))
    assert "20 calls" in line and "positions 3-6" in line
