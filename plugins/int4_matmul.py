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
compute, blocks of 16) keep MatMulNBits. The kernel needs AVX2, FMA and F16C at run time.
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


def covers(attributes: dict, input_count: int) -> bool:
    """Whether Int4MatMul computes what a MatMulNBits node with these attributes and inputs computes."""
    block, k = attributes.get("block_size", 0), attributes.get("K", 0)
    return (
        attributes.get("bits") == 4
        and attributes.get("accuracy_level") == 4
        and input_count == 3
        and block >= 32
        and block & (block - 1) == 0
        and k % block == 0
    )


def use_in_graph(graph_file: Path) -> int:
    """Replace every MatMulNBits node of `graph_file` the kernel covers by Int4MatMul, store those nodes' scales as
    float16 (`half_scales`) and fold the MLP activation into the gate / up node (`fuse_swiglu`); returns how many
    nodes run Int4MatMul."""
    from onnx import helper

    scales, read_by_others = set(), set()

    def replace(node):
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or not covers(attributes, len(node.input)):
            read_by_others.update(node.input)
            return None
        scales.add(node.input[2])
        return helper.make_node(
            "Int4MatMul",
            list(node.input),
            list(node.output),
            name=node.name,
            domain=DOMAIN,
            K=attributes["K"],
            N=attributes["N"],
            block_size=attributes["block_size"],
        )

    count = rewrite_nodes(graph_file, replace)
    rewrite_initializers(graph_file, scales - read_by_others, half_scales)
    fuse_swiglu(graph_file)
    return count


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
        if node.op_type != "Int4MatMul" or node.domain != DOMAIN:
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
            "Int4MatMul",
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
