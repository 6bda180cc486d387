"""onnxruntime backend: one InferenceSession per graph; the cache views are fed without copies."""

from __future__ import annotations

import numpy as np

from engines.format import Artifact, ArtifactError


class OnnxRuntimeBackend:
    def __init__(self, artifact: Artifact, threads: int | None = None, profile_prefix: str | None = None) -> None:
        """`profile_prefix`: write onnxruntime's per-node profile of every session to files with that prefix
        (see end_profiling); it slows each node down, so only `runner bench --profile` uses it."""
        try:
            import onnxruntime as ort
        except ImportError:
            raise ArtifactError("onnxruntime is not installed: pip install onnxruntime (or onnxruntime-gpu)") from None
        manifest = artifact.manifest
        providers = ort.get_available_providers()
        self.provider = "CUDAExecutionProvider" if "CUDAExecutionProvider" in providers else "CPUExecutionProvider"
        if manifest.dtype != "fp32" and self.provider == "CPUExecutionProvider":
            raise ArtifactError(
                f"this engine computes in {manifest.dtype}, which onnxruntime runs on CUDA only; "
                "no CUDAExecutionProvider here (build with --dtype fp32 for CPU)"
            )
        options = _session_options(ort, threads, spinning=True)
        # A small side graph (the draft head's) runs on the calling thread without spinning: a second pool of
        # spinning threads competes with the step graph's for the cores and doubled a verify call's time on 2 cores.
        side_options = _session_options(ort, 1, spinning=False)
        for profiled in (options, side_options) if profile_prefix else ():
            profiled.enable_profiling = True
            profiled.profile_file_prefix = profile_prefix
        side_graphs = {manifest.speculation["graph"]} if manifest.speculation and "graph" in manifest.speculation else set()
        self.sessions = {}
        for key, graph in manifest.graphs.items():
            try:
                self.sessions[key] = ort.InferenceSession(
                    str(artifact.path(graph.file)), side_options if key in side_graphs else options, providers=[self.provider]
                )
            except Exception as err:  # onnxruntime raises its own exception types for damaged graphs
                raise ArtifactError(f"onnxruntime cannot load {graph.file}: {str(err).splitlines()[0]}") from None
        self.output_names = {key: [o.name for o in s.get_outputs()] for key, s in self.sessions.items()}

    def run(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.sessions[graph].run(self.output_names[graph], feeds)
        return dict(zip(self.output_names[graph], outputs))

    def end_profiling(self) -> dict[str, str]:
        """Close the profiles (profile_prefix) and return each graph's profile file (onnxruntime's JSON trace)."""
        return {graph: session.end_profiling() for graph, session in self.sessions.items()}


def _session_options(ort, threads: int | None, spinning: bool):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options
