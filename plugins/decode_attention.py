"""Decode steps' attention: our own onnxruntime CPU kernel (decode_attention.c), a custom op `DecodeAttention` that
takes GroupQueryAttention's place in the step graph under the same contract (plugins/attention.py).

Why: in the int4 default model's decode call (2 threads, Zen 3 VM, graph surgery: the attention nodes replaced by a
slice) onnxruntime's kernel took 1.0 ms of 6.1 at 100 cached tokens and 3.6 ms of 8.9 at 714. It runs each query
head as its own small matrix product, so each kv head's cache is read once per query head that shares it.
For a call where every row adds one token, DecodeAttention reads each cached row once per kv head, splits the
positions into chunks over the session's threads and prefetches rows ahead of use (they come from memory: the
step's weights have streamed through the caches); any other call (prompt chunks, verify trees) it hands to
onnxruntime's own GroupQueryAttention (InvokeOp), so one graph and one session serve every phase and the weights are
packed once. Whole decode calls against onnxruntime's kernel, alternating in one process: 1.02-1.07x at 40-100
cached tokens, 1.10-1.28x at 714; end to end (benchmarks/ab.py, 10 rounds): decode 1.06x on the short chat prompt,
1.08x on the 650-token one.

How it gets into an engine (builder/build.py): `compile_library` builds the kernel with the machine's C compiler into
the artifact (a Linux x86-64 shared library; its hot loop is compiled for AVX2 + FMA and for any x86-64, picked at
load), `use_in_graph` rewrites the step graph's attention nodes, and the step graph's GraphSpec names the library,
which the backend registers. Without a C compiler, on another platform, or for an int8 KV cache (not implemented in
the kernel), the build says why and keeps GroupQueryAttention.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("decode_attention.c")
LIBRARY_NAME = "libdecode_attention.so"
DOMAIN = "llm_engine_builder"
# GroupQueryAttention's inputs (plugins/attention.py) that DecodeAttention takes, in its order: qkv, past_key,
# past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache, position_ids, attention_bias, query_seqlens
GQA_INPUTS_TAKEN = (0, 3, 4, 5, 6, 7, 8, 9, 10, 16)
GQA_INPUTS_NOT_COVERED = (11, 12, 13)  # head_sink, k_scale, v_scale (an int8 cache): the kernel has none of them
GQA_INPUT_COUNT = 17


def unavailable_reason() -> str | None:
    """Why this machine cannot build the kernel, or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernel is built for Linux x86-64, this is {platform.system()} {platform.machine()}"
    if shutil.which("cc") is None:
        return "no C compiler (cc) on this machine"
    return None


def compile_library(out_dir: Path) -> Path:
    """Build the kernel into `out_dir`; a ValueError with the compiler's message if it fails."""
    target = out_dir / LIBRARY_NAME
    command = ["cc", "-O3", "-shared", "-fPIC", "-o", str(target), str(SOURCE), "-lm"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ValueError(f"compiling {SOURCE.name} failed (build with --onnxruntime-decode-attention to do without "
                         f"it):\n{result.stderr[-2000:]}")
    return target


def use_in_graph(graph_file: Path) -> int:
    """Rewrite `graph_file` (the graph only: its initializers stay in the weights file they point to) with every
    fp32-cache GroupQueryAttention node replaced by DecodeAttention. Returns how many nodes were replaced."""
    import onnx
    from onnx import helper

    model = onnx.load(str(graph_file), load_external_data=False)
    replaced = 0
    nodes = []
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            nodes.append(node)
            continue
        inputs = list(node.input) + [""] * (GQA_INPUT_COUNT - len(node.input))
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if any(inputs[i] for i in GQA_INPUTS_NOT_COVERED) or attributes.get("kv_cache_bit_width", 0) or not attributes.get("do_rotary"):
            raise ValueError(f"{node.name}: DecodeAttention covers fp32 caches with rotary embedding only")
        nodes.append(helper.make_node(
            "DecodeAttention", [inputs[i] for i in GQA_INPUTS_TAKEN], list(node.output), name=node.name, domain=DOMAIN,
            num_heads=attributes["num_heads"], kv_num_heads=attributes["kv_num_heads"], scale=attributes["scale"]))
        replaced += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    onnx.save(model, str(graph_file))
    return replaced
