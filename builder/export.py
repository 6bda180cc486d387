"""torch.export of the step graph and its emission as ONNX with weights as one shared external-data file.

One traced graph serves every phase: batch, new-token count, KV length and logits count are symbolic dimensions,
and the phases in the manifest list the fixed bucket shapes the runner pads to. onnxruntime runs any bucket from
the one graph, so weights are loaded once; a backend that wants one engine per shape (TensorRT) builds one
optimisation profile per bucket from the same graph.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import tempfile
import warnings
from pathlib import Path

import torch

from builder import sampler_graph
from builder.model import LlamaForCausalLM
from builder.sampler_graph import CANDIDATES, Sampler
from builder.sampler_graph import INPUT_NAMES as SAMPLER_INPUT_NAMES
from builder.sampler_graph import OUTPUT_NAMES as SAMPLER_OUTPUT_NAMES
from builder.speculation.draft_head import BeamSearchDrafter
from engines.format import GraphSpec, TensorSpec
from plugins import attention, build_cache, collectives, norm, quant_linear

GRAPH_FILE = "model.onnx"
OPSET = 18


def input_names(num_layers: int) -> list[str]:
    return (
        ["input_ids", "positions", "past_lens", "query_lens", "attention_bias", "logits_index"]
        + [f"past_key.{i}" for i in range(num_layers)]
        + [f"past_value.{i}" for i in range(num_layers)]
    )


def output_names(num_layers: int) -> list[str]:
    """present_key.i / present_value.i are the cache buffers with the new tokens written in: the runner binds each
    to the buffer it feeds as past_key.i / past_value.i (see engines.format.KVCacheSpec)."""
    return (
        ["logits", "argmax", "hidden"]
        + [f"present_key.{i}" for i in range(num_layers)]
        + [f"present_value.{i}" for i in range(num_layers)]
    )


DRAFT_GRAPH_FILE = "draft.onnx"
SAMPLER_GRAPH_FILE = "sampler.onnx"
DRAFT_INPUT_NAMES = ["hidden", "last_token"]
DRAFT_OUTPUT_NAMES = ["draft_tokens", "draft_scores"]


def example_inputs(model: LlamaForCausalLM) -> tuple:
    """Inputs of a size that is 1 on no dynamic axis (export would specialise a size-1 axis to a constant)."""
    config = model.config
    batch, steps, past, outputs = 2, 3, 8, 2
    cache = [
        torch.zeros(batch, config.num_kv_heads, past + steps, config.head_dim, dtype=model.kv_cache_dtype)
        for _ in range(config.num_layers)
    ]
    return (
        torch.zeros(batch, steps, dtype=torch.long),
        torch.zeros(batch, steps, dtype=torch.long),
        torch.full((batch,), past - 1, dtype=torch.long),
        torch.full((batch,), steps, dtype=torch.long),
        torch.zeros(batch, 1, steps, past - 1 + steps),
        torch.zeros(batch, outputs, dtype=torch.long),
        cache,
        [c.clone() for c in cache],
    )


def dynamic_shapes(num_layers: int, max_seq_len: int) -> dict:
    batch = torch.export.Dim("batch", min=1, max=1024)
    steps = torch.export.Dim("steps", min=1, max=max_seq_len)
    length = torch.export.Dim("length", min=2, max=4 * max_seq_len)  # the cache buffer's positions
    attended = torch.export.Dim("attended", min=2, max=2 * max_seq_len)  # max(past_lens) + steps
    outputs = torch.export.Dim("outputs", min=1, max=max_seq_len)
    return {
        "input_ids": {0: batch, 1: steps},
        "positions": {0: batch, 1: steps},
        "past_lens": {0: batch},
        "query_lens": {0: batch},
        "attention_bias": {0: batch, 2: steps, 3: attended},
        "logits_index": {0: batch, 1: outputs},
        "past_keys": [{0: batch, 2: length}] * num_layers,
        "past_values": [{0: batch, 2: length}] * num_layers,
    }


def _spec(value_info) -> TensorSpec:
    import onnx

    tensor_type = value_info.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name
    shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor_type.shape.dim]
    return TensorSpec(value_info.name, dtype, shape)


def export_step_graph(
    model: LlamaForCausalLM,
    out_dir: Path,
    max_seq_len: int,
    file: str = GRAPH_FILE,
    translations: dict | None = None,
) -> GraphSpec:
    """The step graph as ONNX; `translations` replace the ONNX engines' lowerings of our ops (TensorRT's)."""
    num_layers = model.config.num_layers
    return _export(
        model,
        example_inputs(model),
        dynamic_shapes(num_layers, max_seq_len),
        out_dir / file,
        input_names(num_layers),
        output_names(num_layers),
        external_data=True,
        translations=translations,
    )


def export_sampler_graph(vocab_size: int, max_depth: int, out_dir: Path, candidates: int = CANDIDATES) -> GraphSpec:
    """The sampler (builder/sampler_graph.py) for this vocabulary and tree depth; rows and tree nodes are dynamic."""
    graph, spec = _sampler_graph(vocab_size, max_depth, candidates)
    (out_dir / SAMPLER_GRAPH_FILE).write_bytes(graph)
    return spec


@functools.cache
def _sampler_graph(vocab_size: int, max_depth: int, candidates: int) -> tuple[bytes, GraphSpec]:
    """The sampler's ONNX bytes and GraphSpec. It has no weights, so every engine with this vocabulary and depth gets
    the same bytes: exported once per process and kept in the build cache (plugins/build_cache.py), since an export
    takes ~35 s whatever the vocabulary (tracing the conditional branches), half of a small model's build. The key:
    the shapes, this module's and the sampler's sources, torch's, onnx's and onnxscript's versions."""
    import onnx

    make = functools.partial(_export_sampler, vocab_size, max_depth, candidates)
    key = sampler_cache_key(vocab_size, max_depth, candidates)
    entry = build_cache.cached_file("sampler-graphs", key, SAMPLER_GRAPH_FILE, make)
    if entry is not None:
        graph = entry.read_bytes()
        return graph, _graph_spec(onnx.load_from_string(graph), SAMPLER_GRAPH_FILE)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / SAMPLER_GRAPH_FILE
        spec = make(path)
        return path.read_bytes(), spec


def sampler_cache_key(vocab_size: int, max_depth: int, candidates: int) -> str:
    import onnx
    import onnxscript

    versions = (torch.__version__, onnx.__version__, onnxscript.__version__)
    sources = (Path(__file__), Path(sampler_graph.__file__))
    return build_cache.digest([str(vocab_size), str(max_depth), str(candidates), *versions, *sources])


def _export_sampler(vocab_size: int, max_depth: int, candidates: int, path: Path) -> GraphSpec:
    batch, nodes = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("nodes", min=1, max=1024)
    args = (
        torch.zeros(2, 3, vocab_size),
        torch.zeros(2, 3, dtype=torch.long),
        torch.full((2, 3), -1),
        torch.eye(3, dtype=torch.bool).expand(2, 3, 3).clone(),
        torch.zeros(2, 3, 2),
        torch.ones(2),
        torch.zeros(2, dtype=torch.long),
        torch.ones(2),
        torch.zeros(2),
        torch.ones(2),
        torch.zeros(2),
        torch.zeros(2),
        torch.zeros(2, vocab_size),
        torch.zeros(2, vocab_size, dtype=torch.bool),
        torch.zeros(2, vocab_size, dtype=torch.bool),
        torch.zeros(2, dtype=torch.long),
        torch.tensor(False),
        torch.zeros(2, vocab_size),
    )
    per_row = {0: batch}
    per_node = {0: batch, 1: nodes}
    shapes = dict(
        zip(
            SAMPLER_INPUT_NAMES,
            [
                per_node,
                per_node,
                per_node,
                {0: batch, 1: nodes, 2: nodes},
                per_node,
                *[per_row] * 11,
                {},
                per_row,
            ],
        )
    )
    return _export(
        Sampler(max_depth, candidates),
        args,
        shapes,
        path,
        SAMPLER_INPUT_NAMES,
        SAMPLER_OUTPUT_NAMES,
        external_data=False,
    )


def export_draft_graph(drafter: BeamSearchDrafter, out_dir: Path) -> GraphSpec:
    """The draft head's beam search as its own small graph (its weights are its own: nothing is shared)."""
    batch = torch.export.Dim("batch", min=1, max=1024)
    hidden_size = drafter.head.config.hidden_size
    args = (torch.zeros(2, hidden_size), torch.zeros(2, dtype=torch.long))
    return _export(
        drafter.eval(),
        args,
        {"hidden": {0: batch}, "last_token": {0: batch}},
        out_dir / DRAFT_GRAPH_FILE,
        DRAFT_INPUT_NAMES,
        DRAFT_OUTPUT_NAMES,
        external_data=False,
    )


def _export(
    module: torch.nn.Module,
    args: tuple,
    shapes: dict,
    path: Path,
    inputs: list[str],
    outputs: list[str],
    external_data: bool,
    translations: dict | None = None,
) -> GraphSpec:
    import onnx

    # The exporter narrates its passes on stdout; the build prints its own progress instead.
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.export.export(module, args, dynamic_shapes=shapes)
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        torch.onnx.export(
            program,
            args,
            str(path),
            input_names=inputs,
            output_names=outputs,
            opset_version=OPSET,
            external_data=external_data,
            dynamo=True,
            optimize=True,
            verbose=False,
            custom_translation_table=translations
            or {
                **quant_linear.onnx_translations(),
                **attention.onnx_translations(),
                **norm.onnx_translations(),
                **collectives.onnx_translations(),
            },
        )
    model = onnx.load(str(path), load_external_data=False)
    if _drop_unused_optional_outputs(model.graph):
        onnx.save(model, str(path))  # the graph only: initializers keep pointing at the external data written above
    return _graph_spec(model, path.name)


def _graph_spec(model, file: str) -> GraphSpec:
    return GraphSpec(file, [_spec(v) for v in model.graph.input], [_spec(v) for v in model.graph.output])


def _drop_unused_optional_outputs(graph) -> int:
    """Unname node outputs that nothing reads where the op's schema says they are optional, so the kernel need not
    write them. The exporter names every output of the fused norm (its mean and inverse std too): 120 small tensors
    per decode step that cost a measurable share of an int4 step (docs/measurements.md). Returns how many it
    dropped."""
    from onnx import defs

    read = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
    dropped = 0
    for node in graph.node:
        try:
            schema = defs.get_schema(node.op_type, OPSET if node.domain in ("", "ai.onnx") else 1, node.domain)
        except defs.SchemaError:
            continue
        for index, name in enumerate(node.output):
            optional = (
                index < len(schema.outputs)
                and schema.outputs[index].option == defs.OpSchema.FormalParameterOption.Optional
            )
            if name and name not in read and optional:
                node.output[index] = ""
                dropped += 1
    return dropped
