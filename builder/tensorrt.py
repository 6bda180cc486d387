"""The TensorRT backend's build: the step graph as ONNX that TensorRT's parser takes, and its engine.

The same model and export as the other backends (builder/export.py), traced with the torch ops
(LlamaForCausalLM.use_torch_ops) and lowered to standard ONNX ops, except the quantized linears, which become
plugin nodes (plugins/tensorrt_plugin.py: the Triton kernel the AOTInductor backend compiles, as a TensorRT
plugin). ONNX has no in-place update, so this graph returns the cache with the new tokens written in
(present_key.i) for the runner to bind to the same memory as past_key.i.

The engine is built with polygraphy from that ONNX, one optimization profile per phase's bucket range. TensorRT
cannot be installed on the machines this was written on: the ONNX is checked there (onnx's checker, onnxruntime
on the graphs without plugin nodes, against the reference), the engine build is not run.
"""

from __future__ import annotations

from pathlib import Path

from builder.export import export_step_graph
from builder.model import LlamaForCausalLM
from engines.format import GraphSpec, PhaseSpec
from engines.model_config import ModelConfig
from engines.target import gpu_architecture
from plugins import tensorrt_plugin

ONNX_FILE = "model.trt.onnx"
ENGINE_FILE = "model.plan"


def unavailable_reason() -> str | None:
    try:
        import polygraphy  # noqa: F401
        import tensorrt  # noqa: F401
    except ImportError as err:
        return f"TensorRT's build needs tensorrt and polygraphy on a machine with the target GPU ({err})"
    return None


def export_tensorrt_onnx(model: LlamaForCausalLM, out_dir: Path, max_seq_len: int) -> GraphSpec:
    model.use_torch_ops()
    return export_step_graph(model, out_dir, max_seq_len, ONNX_FILE, tensorrt_plugin.onnx_translations())


def build_engine_file(
    onnx_path: Path, phases: list[PhaseSpec], config: ModelConfig, max_seq_len: int, out_path: Path
) -> dict[str, str]:
    """Build and save the TensorRT engine; returns the target facts the runner checks (TensorRT version, GPU)."""
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(reason)
    import tensorrt
    from polygraphy.backend.trt import CreateConfig, Profile, engine_from_network, network_from_onnx_path, save_engine

    tensorrt_plugin.register_plugins()
    profiles = []
    for phase in phases:
        profile = Profile()
        for name, (low, opt, high) in profile_shapes(phase, config, max_seq_len).items():
            profile.add(name, min=low, opt=opt, max=high)
        profiles.append(profile)
    engine = engine_from_network(network_from_onnx_path(str(onnx_path)), config=CreateConfig(profiles=profiles))
    save_engine(engine, str(out_path))
    return {"tensorrt": tensorrt.__version__, "gpu": gpu_architecture()}


Shape = tuple[int, ...]


def profile_shapes(phase: PhaseSpec, config: ModelConfig, max_seq_len: int) -> dict[str, tuple[Shape, Shape, Shape]]:
    """One optimization profile covering a phase's buckets: every input's (min, opt, max) shape. Rows and new tokens
    span the phase's buckets; the bias spans what a row can attend (max(past_lens) + tokens); the cache buffer any
    length up to twice the longest sequence (the runner's buffer adds headroom for padded chunks)."""
    rows = (min(phase.batch_sizes), max(phase.batch_sizes))
    steps = (min(phase.steps), max(phase.steps))
    outputs = (1, 1) if phase.logits == "last" else steps
    attended = (steps[0], max_seq_len + steps[1])
    length = (steps[1] + 1, 2 * max_seq_len)

    def dims(*sizes):  # each size a (min, max) range or a fixed int -> (min, opt, max) shapes; opt = max
        low = tuple(s if isinstance(s, int) else s[0] for s in sizes)
        high = tuple(s if isinstance(s, int) else s[1] for s in sizes)
        return low, high, high

    shapes = {
        "input_ids": dims(rows, steps),
        "positions": dims(rows, steps),
        "past_lens": dims(rows),
        "query_lens": dims(rows),
        "attention_bias": dims(rows, 1, steps, attended),
        "logits_index": dims(rows, outputs),
    }
    cache = dims(rows, config.num_kv_heads, length, config.head_dim)
    for i in range(config.num_layers):
        shapes[f"past_key.{i}"] = shapes[f"past_value.{i}"] = cache
    return shapes
