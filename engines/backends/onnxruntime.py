"""onnxruntime backend: one InferenceSession per graph; the cache views are fed without copies."""

from __future__ import annotations

import numpy as np

from engines.format import Artifact, ArtifactError


class OnnxRuntimeBackend:
    def __init__(self, artifact: Artifact, threads: int | None = None) -> None:
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
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = threads
        self.sessions = {}
        for key, graph in manifest.graphs.items():
            try:
                self.sessions[key] = ort.InferenceSession(
                    str(artifact.path(graph.file)), options, providers=[self.provider]
                )
            except Exception as err:  # onnxruntime raises its own exception types for damaged graphs
                raise ArtifactError(f"onnxruntime cannot load {graph.file}: {str(err).splitlines()[0]}") from None
        self.output_names = {key: [o.name for o in s.get_outputs()] for key, s in self.sessions.items()}

    def run(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.sessions[graph].run(self.output_names[graph], feeds)
        return dict(zip(self.output_names[graph], outputs))
