"""The step graph compiled ahead of time by AOTInductor (torch's own compiler) into a package in the artifact.

The same model, the same export (builder/export.py's inputs, dynamic shapes and names) and the same contract as
the ONNX step graph: the runner's code does not know which backend it drives. Two things differ, both inside the
model (LlamaForCausalLM.use_torch_ops): attention is plain torch ops that write the new K/V into the cache tensors
passed in (an input mutation that AOTInductor performs on the runner's buffers, so present_key.i *is* past_key.i
and the package has no cache outputs), and quantized linears call plugins::blockwise_matmul, whose Triton kernel
is compiled into a CUDA package (a CPU package gets the op's float reference: dequantize, then matmul).
"""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from builder.export import dynamic_shapes, example_inputs, input_names, output_names
from builder.model import LlamaForCausalLM
from engines.format import GraphSpec, TensorSpec
from engines.target import gpu_architecture, torch_version
from plugins.quant_linear import QuantizedLinear

PACKAGE_FILE = "model.pt2"
DEVICES = ("cpu", "cuda")


class StepGraph(nn.Module):
    """The model's forward without its cache outputs: they are the cache inputs, written in place."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids, positions, past_lens, query_lens, attention_bias, logits_index, past_keys, past_values
    ):
        return self.model(
            input_ids, positions, past_lens, query_lens, attention_bias, logits_index, past_keys, past_values
        )[:3]


def unavailable_reason(device: str) -> str | None:
    if device not in DEVICES:
        return f"unknown device {device!r}; choose one of {', '.join(DEVICES)}"
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device here: build --device cuda engines on a machine with the GPU they will run on"
    return None


def target_facts(device: str) -> dict[str, str]:
    """What a package is compiled for and must find again where it runs (the runner compares them)."""
    facts = {"torch": torch_version()}
    if device == "cuda":
        facts["gpu"] = gpu_architecture()
        facts["cuda"] = str(torch.version.cuda)
    return facts


def export_aoti_step_graph(model: LlamaForCausalLM, out_dir: Path, max_seq_len: int, device: str) -> GraphSpec:
    reason = unavailable_reason(device)
    if reason is not None:
        raise ValueError(reason)
    model.use_torch_ops()
    model.to(device)
    quantized = any(isinstance(module, QuantizedLinear) for module in model.modules())
    num_layers = model.config.num_layers
    args = tuple(_to(arg, device) for arg in example_inputs(model))
    shapes = dynamic_shapes(num_layers, max_seq_len)
    # The exporter and Inductor narrate on stdout and warn freely; the build prints its own progress.
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.getLogger("torch._inductor").setLevel(logging.ERROR)
        # Guards the shape solver cannot prove over the whole range (torch 2.11 cannot show that a stride of the
        # attention output, min(head_dim, group * steps * head_dim), is head_dim for steps >= 1) become runtime
        # asserts in the graph instead of failing the export.
        program = torch.export.export(
            StepGraph(model), args, dynamic_shapes=shapes, prefer_deferred_runtime_asserts_over_guards=True
        )
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(out_dir / PACKAGE_FILE), inductor_configs=_inductor_configs(device, quantized)
        )
    check_package_loads(out_dir / PACKAGE_FILE)
    return GraphSpec(PACKAGE_FILE, _specs(input_names(num_layers), args, shapes), _output_specs(model, args))


# Loads a package the way the runner does, in a process of its own: a package that crashes its loader fails the
# build with the reason, instead of the runner later.
LOAD_CHECK = "import sys, torch; torch._inductor.aoti_load_package(sys.argv[1], run_single_threaded=True)"


def check_package_loads(package: Path) -> None:
    """Refuse a package that does not load. Seen: packages compiled through a compiler wrapper (CXX pointing to a
    script around g++, as on one CUDA image) crashed the loader with a segmentation fault, while the same compiler
    called directly made packages that load and run."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    run = subprocess.run([sys.executable, "-c", LOAD_CHECK, str(package)], capture_output=True, text=True)
    if run.returncode == 0:
        return
    compiler = get_cpp_compiler()
    reason = f"signal {-run.returncode}" if run.returncode < 0 else (run.stderr.strip().splitlines() or ["?"])[-1]
    raise RuntimeError(
        f"the compiled package does not load ({reason}); it was compiled with {compiler} (CXX). A compiler wrapper "
        "can make packages that crash when loaded: build again with CXX set to the compiler itself, e.g. CXX=g++"
    )


def _inductor_configs(device: str, quantized: bool) -> dict:
    """On CPU, freezing: the weights become constants Inductor can repack for its matmul library (the default
    model's 49152 x 576 LM head at one row: 5.1 ms against 10.6 ms unfrozen; docs/measurements.md). Not for
    quantized weights: freezing folds their dequantization into float constants, a float engine in disguise."""
    return {"freezing": True} if device == "cpu" and not quantized else {}


def _to(arg, device: str):
    return [t.to(device) for t in arg] if isinstance(arg, list) else arg.to(device)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _specs(names: list[str], args: tuple, shapes: dict) -> list[TensorSpec]:
    tensors = [t for arg in args for t in (arg if isinstance(arg, list) else [arg])]
    dims = [d for shape in shapes.values() for d in (shape if isinstance(shape, list) else [shape])]
    return [
        TensorSpec(name, _dtype_name(t.dtype), [dim[i].__name__ if i in dim else t.shape[i] for i in range(t.dim())])
        for name, t, dim in zip(names, tensors, dims)
    ]


def _output_specs(model: LlamaForCausalLM, args: tuple) -> list[TensorSpec]:
    """logits, argmax and hidden as the package returns them; present_key.i / present_value.i as the cache inputs
    they are (written in place, not returned)."""
    config, cache = model.config, args[6][0]
    names = output_names(config.num_layers)
    per_token = [
        TensorSpec(names[0], "float32", ["batch", "outputs", config.vocab_size]),
        TensorSpec(names[1], "int64", ["batch", "outputs"]),
        TensorSpec(names[2], "float32", ["batch", "outputs", config.hidden_size]),
    ]
    cache_shape = ["batch", config.num_kv_heads, "length", config.head_dim]
    return per_token + [TensorSpec(name, _dtype_name(cache.dtype), cache_shape) for name in names[3:]]
