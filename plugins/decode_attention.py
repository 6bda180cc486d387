"""Decode and verify steps' attention: our own onnxruntime CPU kernel (decode_attention.c), a custom op
`DecodeAttention` that takes GroupQueryAttention's place in the step graph under the same contract
(plugins/attention.py).

Why: in the int4 default model's decode call onnxruntime's kernel took a sixth of the call at 100 cached tokens and
two fifths at 714 (docs/measurements.md). It runs each query head as its own small matrix product, so each kv head's
cache is read once per query head that shares it.
For a call where every row adds up to 16 tokens (decode steps, verify trees, short prompt chunks), DecodeAttention
reads each cached row once per kv head for all the row's new tokens and query heads, splits the positions into
chunks over the session's threads and prefetches rows ahead of use (they come from memory: the step's weights have
streamed through the caches). Each query is computed exactly as a decode step of its token would compute it, so a
verify step agrees with plain decoding bit for bit (what speculation on int8-activation engines needs to keep the
greedy tokens). Longer prompt chunks it hands to onnxruntime's own GroupQueryAttention (InvokeOp), so one graph and
one session serve every phase and the weights are packed once. What it gains: docs/measurements.md.

An int8 KV cache (static per-channel scales, plugins/attention.py) runs the same kernel as
`DecodeAttentionInt8Cache`: it writes each new K/V row as round(x / scale) saturated to int8 and turns the rows a
unit of work reads into floats (int8 x scale, the reference's own product) in a buffer of the unit's, so every query
computes as over a float cache of those values, bit for bit alike in decode and verify calls, while the rows come
from memory at a quarter of the bytes.

How it gets into an engine: plugins/native_ops.py builds it into our kernel library; `use_in_graph` rewrites the
step graph's attention nodes.
"""

from __future__ import annotations

from pathlib import Path

from plugins.native_ops import DOMAIN, rewrite_nodes

# GroupQueryAttention's inputs (plugins/attention.py) that DecodeAttention takes, in its order: qkv, past_key,
# past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache, position_ids, attention_bias, query_seqlens
GQA_INPUTS_TAKEN = (0, 3, 4, 5, 6, 7, 8, 9, 10, 16)
GQA_HEAD_SINK = 11  # the kernel has none
GQA_CACHE_SCALES = (12, 13)  # k_scale, v_scale: an int8 cache's, after the inputs above in DecodeAttentionInt8Cache
GQA_INPUT_COUNT = 17


def use_in_graph(graph_file: Path) -> int:
    """Replace every GroupQueryAttention node of `graph_file` by DecodeAttention (an fp32 cache) or
    DecodeAttentionInt8Cache (an int8 cache with per-channel scales); returns how many."""
    from onnx import helper

    def replace(node):
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            return None
        inputs = list(node.input) + [""] * (GQA_INPUT_COUNT - len(node.input))
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        scales = [inputs[i] for i in GQA_CACHE_SCALES]
        int8_cache = attributes.get("kv_cache_bit_width", 0) == 8 and all(scales)
        per_channel = all(attributes.get(f"{kv}_quant_type") == b"PER_CHANNEL" for kv in "kv")
        if (
            inputs[GQA_HEAD_SINK]
            or not attributes.get("do_rotary")
            or (int8_cache and not per_channel)
            or (not int8_cache and (any(scales) or attributes.get("kv_cache_bit_width", 0)))
        ):
            raise ValueError(
                f"{node.name}: DecodeAttention covers fp32 caches and int8 ones with per-channel scales, with rotary "
                "embedding"
            )
        return helper.make_node(
            "DecodeAttentionInt8Cache" if int8_cache else "DecodeAttention",
            [inputs[i] for i in GQA_INPUTS_TAKEN] + (scales if int8_cache else []),
            list(node.output),
            name=node.name,
            domain=DOMAIN,
            num_heads=attributes["num_heads"],
            kv_num_heads=attributes["kv_num_heads"],
            scale=attributes["scale"],
        )

    return rewrite_nodes(graph_file, replace)
