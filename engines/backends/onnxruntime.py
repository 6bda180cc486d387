"""onnxruntime backend: one InferenceSession per graph; the KV cache buffers are bound by address (IO binding), so
the graph reads and updates them in place."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from engines.format import Artifact, ArtifactError


class OnnxRuntimeBackend:
    def __init__(
        self,
        artifact: Artifact,
        threads: int | None = None,
        profile_prefix: str | None = None,
        graphs: set[str] | None = None,
    ) -> None:
        """`profile_prefix`: write onnxruntime's per-node profile of every session to files with that prefix
        (see end_profiling); it slows each node down, so only `runner bench --profile` uses it. `graphs`: open only
        these of the manifest's graphs (the side graphs of an engine whose step graph another backend runs)."""
        try:
            import onnxruntime as ort
        except ImportError:
            raise ArtifactError("onnxruntime is not installed: pip install onnxruntime (or onnxruntime-gpu)") from None
        manifest = artifact.manifest
        providers = ort.get_available_providers()
        self.provider = "CUDAExecutionProvider" if "CUDAExecutionProvider" in providers else "CPUExecutionProvider"
        graphs = set(manifest.graphs) if graphs is None else graphs
        side_graphs = {manifest.sampler.graph}
        if manifest.speculation is not None and manifest.speculation.graph is not None:
            side_graphs.add(manifest.speculation.graph)
        if manifest.dtype != "fp32" and self.provider == "CPUExecutionProvider" and graphs - side_graphs:
            raise ArtifactError(
                f"this engine computes in {manifest.dtype}, which onnxruntime runs on CUDA only; "
                "no CUDAExecutionProvider here (build with --dtype fp32 for CPU)"
            )
        options = session_options(ort, threads, spinning=True)
        # Small side graphs (the sampler, the draft head) run on the calling thread without spinning: a second pool
        # of spinning threads competes with the step graph's for the cores and doubled a verify call's time on 2 cores.
        side_options = session_options(ort, 1, spinning=False)
        for profiled in (options, side_options) if profile_prefix else ():
            profiled.enable_profiling = True
            profiled.profile_file_prefix = profile_prefix
        for graph_options in (options, side_options):  # the draft graph's quantized linears run our kernels too
            register_native_libraries(graph_options, artifact)
        self.quantized_matmul_tiles = quantized_matmul_tiles(artifact)
        self.sessions = {}
        for key, graph in manifest.graphs.items():
            if key not in graphs:
                continue
            try:
                self.sessions[key] = ort.InferenceSession(
                    str(artifact.path(graph.file)),
                    side_options if key in side_graphs else options,
                    providers=[self.provider],
                )
            except Exception as err:  # onnxruntime raises its own exception types for damaged graphs
                raise ArtifactError(f"onnxruntime cannot load {graph.file}: {str(err).splitlines()[0]}") from None
        self.output_names = {key: [o.name for o in s.get_outputs()] for key, s in self.sessions.items()}

    def run(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.sessions[graph].run(self.output_names[graph], feeds)
        return dict(zip(self.output_names[graph], outputs))

    def bind(self, graph: str, buffers: dict[str, np.ndarray]) -> BoundGraph:
        """`graph` with `buffers` (input or output name -> C-contiguous array) bound by address once, for many runs."""
        return BoundGraph(self.sessions[graph], buffers)

    def end_profiling(self) -> dict[str, str]:
        """Close the profiles (profile_prefix) and return each graph's profile file (onnxruntime's JSON trace)."""
        return {graph: session.end_profiling() for graph, session in self.sessions.items()}


def session_options(ort, threads: int | None, spinning: bool):
    """The engine's session options (benchmarks/graph_parity.py runs a peer's graph with the same ones)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    else:
        # Spin between a run's nodes, but stop when the run ends: another session's run comes next on the same cores
        # (a draft model's engine: with both pools spinning, its draft calls and the target's verify calls each took
        # about twice as long; no change to a plain engine; docs/measurements.md)
        options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


def quantized_matmul_tiles(artifact: Artifact) -> str | None:
    """The tiles our quantized matmul kernels (Int4MatMul, Int8MatMul) take on this CPU, as the engine's kernel
    library decides them: "avx2" or "avx512vnni"; None where the step graph runs neither."""
    step = artifact.manifest.graphs.get("step")
    if step is None or not step.native_library or not {"Int4MatMul", "Int8MatMul"} & set(step.native_ops):
        return None
    return kernel_library_tiles(artifact.path(step.native_library))


def kernel_library_tiles(library: Path) -> str:
    """The tiles a kernel library's quantized matmuls take on this CPU (its QuantizedMatMulIsa): "avx2" or
    "avx512vnni", as a kernel created now would (LLM_ENGINE_BUILDER_KERNEL_ISA=avx2 included)."""
    isa = ctypes.CDLL(str(library)).QuantizedMatMulIsa
    isa.restype = ctypes.c_char_p
    return isa().decode()


def register_native_libraries(options, artifact: Artifact) -> None:
    """Register with these session options the kernel libraries of our own ops (plugins/native_ops.py) that the
    artifact's graphs use; an ArtifactError names a library onnxruntime cannot load."""
    manifest = artifact.manifest
    for library in sorted({g.native_library for g in manifest.graphs.values() if g.native_library}):
        try:
            options.register_custom_ops_library(str(artifact.path(library)))
        except Exception as err:  # onnxruntime raises its own exception types for a library it cannot load
            raise ArtifactError(
                f"onnxruntime cannot load the engine's kernel library {library}: {str(err).splitlines()[0]}"
            ) from None


class BoundGraph:
    """A session with some inputs and outputs bound to fixed memory. An array bound both as an input and as an
    output is read and written in place (the KV cache: past_key.i and present_key.i). Binding the cache tensors costs
    a few percent of a decode step, so it is done once per buffer generation, not per run; each run binds its small
    inputs and the arrays its other outputs are written into (fetching outputs back from onnxruntime would wrap every
    output, the cache ones too; docs/measurements.md)."""

    def __init__(self, session, buffers: dict[str, np.ndarray]) -> None:
        self.session = session
        self.binding = session.io_binding()
        inputs = {i.name for i in session.get_inputs()}
        for name, array in buffers.items():
            bind = self.binding.bind_input if name in inputs else self.binding.bind_output
            bind(name, "cpu", 0, array.dtype, list(array.shape), _address(name, array))
        self.buffers = buffers  # the bound memory must outlive the binding
        self.per_run_inputs = inputs - set(buffers)
        self.per_run_outputs = {o.name for o in session.get_outputs()} - set(buffers)

    def run(self, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        """Run with these inputs, writing the remaining outputs into `outputs` (arrays of their exact shapes)."""
        # a name left out would keep the previous run's binding, whose memory may be gone
        if set(feeds) != self.per_run_inputs:
            raise ValueError(f"every input not bound for good needs a value: {sorted(self.per_run_inputs)}")
        if set(outputs) != self.per_run_outputs:
            raise ValueError(f"every output not bound for good needs an array: {sorted(self.per_run_outputs)}")
        for name, value in feeds.items():
            self.binding.bind_cpu_input(name, value)
        for name, array in outputs.items():
            self.binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), _address(name, array))
        self.session.run_with_iobinding(self.binding)


def _address(name: str, array: np.ndarray) -> int:
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: only contiguous memory can be bound")
    return array.ctypes.data
