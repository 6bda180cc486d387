"""Our onnxruntime CPU kernels, compiled into one custom-op library that ships inside an engine:
DecodeAttention (decode_attention.c, plugins/decode_attention.py), Int4MatMul (int4_matmul.c,
plugins/int4_matmul.py), ArgMax (argmax.c, plugins/argmax.py) and the tensor-parallel AllReduce / AllGather
(collectives.c, plugins/collectives.py), registered in our domain by native_ops.c; ort_abi.h declares what
they use of onnxruntime's C ABI.

`builder build` compiles the library with the machine's C compiler into the artifact (a Linux x86-64 shared
library; its hot loops are compiled for AVX2 + FMA, with AVX-512 variants the CPU picks at run time), rewrites the
step graph's nodes that one of the kernels covers, and names the library in the step graph's GraphSpec, which the
backend registers. Where it cannot be compiled, the build says why and keeps onnxruntime's own ops.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np

from plugins import build_cache

HERE = Path(__file__).parent
SOURCES = (
    HERE / "decode_attention.c",
    HERE / "int4_matmul.c",
    HERE / "argmax.c",
    HERE / "norm.c",
    HERE / "collectives.c",
    HERE / "native_ops.c",
)
ABI_HEADER = HERE / "ort_abi.h"
LIBRARY_NAME = "libnative_ops.so"
COMPILE_FLAGS = ("-O3", "-shared", "-fPIC")
DOMAIN = "llm_engine_builder"


def unavailable_reason() -> str | None:
    """Why this machine cannot build the library, or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are built for Linux x86-64, this is {platform.system()} {platform.machine()}"
    if shutil.which("cc") is None:
        return "no C compiler (cc) on this machine"
    return None


def compile_library(out_dir: Path) -> Path:
    """The library in `out_dir`: a copy of the one this compiler made from these sources before (the build cache,
    plugins/build_cache.py), else compiled now and kept there; a ValueError with the compiler's message if it
    fails."""
    target = out_dir / LIBRARY_NAME
    cached = _cached_library()
    if cached is None:
        return _compile(target)
    shutil.copy(cached, target)
    return target


def _cached_library() -> Path | None:
    """The compiled library for the sources as they are, from the build cache or compiled into it (None where the
    cache cannot be written). A build would otherwise compile the same ~1,900 lines of C (~10 s of one core) every
    time. The key covers every source, the flags and the compiler's identity: an edited kernel or another compiler
    compiles anew."""
    key = build_cache.digest([*COMPILE_FLAGS, _compiler_identity(), *SOURCES, ABI_HEADER])
    return build_cache.cached_file("kernels", key, LIBRARY_NAME, _compile)


def _compiler_identity() -> str:
    """The compiler's path and version banner (`cc --version`), which change when it is replaced or upgraded."""
    compiler = shutil.which("cc")
    banner = subprocess.run(["cc", "--version"], capture_output=True, text=True, check=False).stdout
    return f"{compiler and os.path.realpath(compiler)}\n{banner}"


def _compile(target: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    command = ["cc", *COMPILE_FLAGS, *extra_flags, "-o", str(target), *map(str, SOURCES), "-lm"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ValueError(
            "compiling our kernels failed (build with --onnxruntime-decode-attention "
            f"--onnxruntime-quantized-matmul to do without them):\n{result.stderr[-2000:]}"
        )
    return target


def float_tensors(graph) -> set[str]:
    """Names of `graph`'s float32 tensors whose type it states: inputs, outputs, inferred values and initializers
    (the types our kernels' replacements check their inputs against)."""
    import onnx

    typed = [*graph.input, *graph.output, *graph.value_info]
    return {value.name for value in typed if value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT} | {
        tensor.name for tensor in graph.initializer if tensor.data_type == onnx.TensorProto.FLOAT
    }


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


def rewrite_initializers(
    graph_file: Path,
    converts: dict[str, Callable[[np.ndarray], np.ndarray | None]],
    added: dict[str, np.ndarray] | None = None,
) -> set[str]:
    """Store each initializer named in `converts` of `graph_file` as its function returns it (another dtype or
    shape; None keeps one as it is), and the `added` ones besides (at the end of the graph's first weights file, or
    in the graph where it has none). The weights files the graph points to are written anew one tensor at a time, so
    no more than the largest converted tensor is ever in memory. Returns the names converted."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(graph_file), load_external_data=False)
    converted = set()
    files: dict[str, list] = {}
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            files.setdefault(_external(tensor)["location"], []).append(tensor)
        elif tensor.name in converts and (new := converts[tensor.name](numpy_helper.to_array(tensor))) is not None:
            tensor.CopyFrom(numpy_helper.from_array(new, tensor.name))
            converted.add(tensor.name)
    for location, tensors in files.items():
        source = graph_file.parent / location
        staged = source.with_name(source.name + ".rewriting")
        with open(source, "rb") as old, open(staged, "wb") as new_file:
            for tensor in sorted(tensors, key=lambda t: int(_external(t).get("offset", 0))):
                entries = _external(tensor)
                old.seek(int(entries.get("offset", 0)))
                length = int(entries["length"])
                new = None
                if tensor.name in converts:
                    array = np.frombuffer(old.read(length), helper.tensor_dtype_to_np_dtype(tensor.data_type))
                    new = converts[tensor.name](array.reshape(tuple(tensor.dims)))
                    if new is None:
                        old.seek(-length, os.SEEK_CUR)
                offset = new_file.tell()
                if new is None:
                    _copy(old, new_file, length)
                else:
                    new_file.write(np.ascontiguousarray(new).tobytes())
                    tensor.data_type = helper.np_dtype_to_tensor_dtype(new.dtype)
                    del tensor.dims[:]
                    tensor.dims.extend(new.shape)
                    converted.add(tensor.name)
                _set_external(tensor, offset=offset, length=new_file.tell() - offset)
        os.replace(staged, source)
    for name, array in (added or {}).items():
        tensor = numpy_helper.from_array(np.ascontiguousarray(array), name)
        if files:
            location = next(iter(files))
            with open(graph_file.parent / location, "ab") as weights:
                offset = weights.tell()
                length = weights.write(tensor.raw_data)
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            _set_external(tensor, location=location, offset=offset, length=length)
        model.graph.initializer.append(tensor)
    onnx.save(model, str(graph_file))
    return converted


def _external(tensor) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def _set_external(tensor, **values: int) -> None:
    entries = _external(tensor) | {key: str(value) for key, value in values.items()}
    del tensor.external_data[:]
    for key, value in entries.items():
        tensor.external_data.add(key=key, value=value)


def _copy(source, target, length: int, chunk: int = 64 << 20) -> None:
    while length > 0:
        data = source.read(min(chunk, length))
        if not data:
            raise ValueError(f"{source.name} ends before the tensors its graph points to")
        target.write(data)
        length -= len(data)
