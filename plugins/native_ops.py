"""Our onnxruntime CPU kernels, compiled into one custom-op library that ships inside an engine:
DecodeAttention (decode_attention.c, plugins/decode_attention.py) and Int4MatMul (int4_matmul.c,
plugins/int4_matmul.py), registered in our domain by native_ops.c; ort_abi.h declares what they use of
onnxruntime's C ABI.

`builder build` compiles the library with the machine's C compiler into the artifact (a Linux x86-64 shared
library; its hot loops are compiled for AVX2 + FMA), rewrites the step graph's nodes that one of the kernels covers,
and names the library in the step graph's GraphSpec, which the backend registers. Where it cannot be compiled, the
build says why and keeps onnxruntime's own ops.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "decode_attention.c", HERE / "int4_matmul.c", HERE / "native_ops.c")
ABI_HEADER = HERE / "ort_abi.h"
LIBRARY_NAME = "libnative_ops.so"
DOMAIN = "llm_engine_builder"


def unavailable_reason() -> str | None:
    """Why this machine cannot build the library, or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are built for Linux x86-64, this is {platform.system()} {platform.machine()}"
    if shutil.which("cc") is None:
        return "no C compiler (cc) on this machine"
    return None


def compile_library(out_dir: Path) -> Path:
    """Build the library into `out_dir`; a ValueError with the compiler's message if it fails."""
    target = out_dir / LIBRARY_NAME
    command = ["cc", "-O3", "-shared", "-fPIC", "-o", str(target), *map(str, SOURCES), "-lm"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ValueError("compiling our kernels failed (build with --onnxruntime-decode-attention "
                         f"--onnxruntime-int4-matmul to do without them):\n{result.stderr[-2000:]}")
    return target


def rewrite_nodes(graph_file: Path, replace) -> int:
    """Rewrite `graph_file` (the graph only: its initializers stay in the weights file they point to), each node
    through `replace(node)`, which returns a new node or None to keep it; adds our domain to the opsets. Returns how
    many nodes were replaced."""
    import onnx
    from onnx import helper

    model = onnx.load(str(graph_file), load_external_data=False)
    nodes, replaced = [], 0
    for node in model.graph.node:
        new = replace(node)
        nodes.append(node if new is None else new)
        replaced += new is not None
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if replaced and all(o.domain != DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    onnx.save(model, str(graph_file))
    return replaced
