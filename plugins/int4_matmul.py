"""Int4 weight-only matmuls: our own onnxruntime CPU kernel (int4_matmul.c), a custom op `Int4MatMul` that takes
com.microsoft::MatMulNBits's place in the step graph for int4 weights with int8 activations (accuracy_level 4), on
the same nibble layout (plugins/quant_linear.py), its scales stored as float16 (`half_scales`), and the MLP's
activation folded into the gate / up projection's node (`fuse_swiglu`).

Why: its result for a row does not depend on the other rows of the call (batch invariance), where onnxruntime's
kernel rounds one row differently from several, so an engine had to pad one-row decode calls to two rows to keep a
request's greedy tokens the same alone and in a batch (`Executor.pad_single_rows_if_they_round_differently`). Opened
for one stream (nothing to pad) the two decode alike: both stream the weights as fast as memory serves them
(docs/measurements.md). Results match onnxruntime's int8 path to float rounding (the same per-32 activation
quantization).

Covered: bits 4, accuracy_level 4, blocks of a power of 2 from 32 that divides K; other nodes (int8 weights, fp32
compute, blocks of 16) keep MatMulNBits. Int4 blocks with minimums (GGUF Q4_1: w = scale * q + minimum, float16
minimums as the file holds them) are exported as Int4MatMul nodes with a fourth input already
(plugins/quant_linear.py), which MatMulNBits cannot express exactly. The kernel needs AVX2, FMA and F16C at run
time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plugins.native_ops import DOMAIN, rewrite_initializers, rewrite_nodes


def unavailable_reason(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """Why an engine built on this machine should not run the kernel (it needs AVX2, FMA and F16C), or None."""
    flags = (
        next(
            (line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), []
        )
        if cpuinfo.is_file()
        else []
    )
    missing = [flag for flag in ("avx2", "fma", "f16c") if flag not in flags]
    return f"this CPU lacks {' and '.join(f.upper() for f in missing)}, which the kernel needs" if missing else None


OPS = {4: "Int4MatMul", 8: "Int8MatMul"}  # bits -> our op


def kernel_for(attributes: dict, input_count: int) -> str | None:
    """Our op that computes what a MatMulNBits node with these attributes and inputs computes, or None."""
    block, k = attributes.get("block_size", 0), attributes.get("K", 0)
    covered = (
        attributes.get("accuracy_level") == 4
        and input_count == 3
        and block >= 32
        and block & (block - 1) == 0
        and k % block == 0
    )
    return OPS.get(attributes.get("bits")) if covered else None


def use_in_graph(graph_file: Path) -> dict[str, int]:
    """Replace every MatMulNBits node of `graph_file` our kernels cover by Int4MatMul / Int8MatMul, store the
    scales of every int4 node (those and the ones exported as such) as float16 (`half_scales`; int8 nodes' only
    where float16 holds them exactly, as GGUF Q8_0's), and fold the MLP activation into the gate / up node
    (`fuse_swiglu`); returns how many nodes run each op."""
    from onnx import helper

    scales = {op: set() for op in OPS.values()}
    read_by_others = set()
    counts = dict.fromkeys(OPS.values(), 0)

    def replace(node):
        if node.op_type in counts and node.domain == DOMAIN:  # exported as ours (int4 blocks with minimums)
            scales[node.op_type].add(node.input[2])
            counts[node.op_type] += 1
            return None
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        op = kernel_for(attributes, len(node.input)) if node.op_type == "MatMulNBits" else None
        if op is None or node.domain != "com.microsoft":
            read_by_others.update(node.input)
            return None
        scales[op].add(node.input[2])
        counts[op] += 1
        return helper.make_node(
            op,
            list(node.input),
            list(node.output),
            name=node.name,
            domain=DOMAIN,
            K=attributes["K"],
            N=attributes["N"],
            block_size=attributes["block_size"],
        )

    rewrite_nodes(graph_file, replace)
    rewrite_initializers(graph_file, scales["Int4MatMul"] - read_by_others, half_scales)
    rewrite_initializers(graph_file, scales["Int8MatMul"] - read_by_others, exact_half_scales)
    fuse_swiglu(graph_file)
    return counts


def fuse_swiglu(graph_file: Path) -> int:
    """Fold each MLP activation after an Int4MatMul into it (its `swiglu` attribute): the product's halves split,
    silu(gate) * up as the exporter writes it (Split -> Sigmoid, Mul(gate, sigmoid), Mul(silu, up)), nothing else
    reading what is in between. Three fewer kernels a layer. Returns how many it folded."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(graph_file), load_external_data=False)
    graph = model.graph
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {value.name for value in graph.output}
    constants = {t.name: t for t in graph.initializer}

    def only_reader(name: str, op: str):
        found = readers.get(name, [])
        return found[0] if len(found) == 1 and found[0].op_type == op and name not in outputs else None

    removed, fused = set(), {}
    for node in graph.node:
        if node.op_type not in OPS.values() or node.domain != DOMAIN:
            continue
        half = next(a.i for a in node.attribute if a.name == "N") // 2
        split = only_reader(node.output[0], "Split")
        # along the last axis of the [batch, tokens, N] product (Split's axis defaults to 0)
        if (
            split is None
            or len(split.output) != 2
            or next((a.i for a in split.attribute if a.name == "axis"), 0) not in (-1, 2)
        ):
            continue
        if len(split.input) > 1 and (
            split.input[1] not in constants or numpy_helper.to_array(constants[split.input[1]]).tolist() != [half, half]
        ):
            continue
        gate, up = split.output
        gate_readers, up_reader = readers.get(gate, []), only_reader(up, "Mul")
        sigmoid = next((r for r in gate_readers if r.op_type == "Sigmoid"), None)
        silu = next((r for r in gate_readers if r.op_type == "Mul"), None)
        if (
            len(gate_readers) != 2
            or sigmoid is None
            or silu is None
            or gate in outputs
            or up_reader is None
            or set(silu.input) != {gate, sigmoid.output[0]}
            or only_reader(sigmoid.output[0], "Mul") is not silu
            or only_reader(silu.output[0], "Mul") is not up_reader
            or set(up_reader.input) != {silu.output[0], up}
        ):
            continue
        fused[id(node)] = helper.make_node(
            node.op_type,
            list(node.input),
            list(up_reader.output),
            name=node.name,
            domain=DOMAIN,
            **{a.name: helper.get_attribute_value(a) for a in node.attribute},
            swiglu=1,
        )
        removed.update(id(n) for n in (split, sigmoid, silu, up_reader))
    if fused:
        nodes = [fused.get(id(n), n) for n in graph.node if id(n) not in removed]
        del graph.node[:]
        graph.node.extend(nodes)
        onnx.save(model, str(graph_file))
    return len(fused)


def half_scales(scales: np.ndarray) -> np.ndarray | None:
    """The scales as float16, which the kernel reads as well as float: a weight streams 4.5 bits from memory instead
    of 5, and decode is bound by that stream. Their rounding (relative 2^-11) is ~1/100 of the int4 rounding of the
    weights they scale (a step of 1/7 of a block's largest magnitude); None where one would overflow float16."""
    half = scales.astype(np.float16)
    return half if np.isfinite(half).all() else None


def exact_half_scales(scales: np.ndarray) -> np.ndarray | None:
    """The scales as float16 where that loses nothing (GGUF Q8_0's are float16 in the file), else None: int8
    weights round 16x finer than int4, so a float16 scale's rounding would no longer be small against theirs."""
    half = scales.astype(np.float16)
    return half if np.array_equal(half.astype(scales.dtype), scales) else None
