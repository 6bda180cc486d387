"""TensorRT backend: refuses, in one line, an engine this machine cannot run (no TensorRT, another TensorRT version
or another GPU than the engine was built for). Running TensorRT engines is not implemented in this runner yet:
TensorRT cannot be installed on the machines it was written on, so no engine was ever built to run."""

from __future__ import annotations

from engines.format import Artifact, ArtifactError
from engines.target import check_target, gpu_architecture


class TensorRTBackend:
    def __init__(self, artifact: Artifact) -> None:
        try:
            import tensorrt
        except ImportError:
            raise ArtifactError("this is a TensorRT engine: its runner needs tensorrt (pip install tensorrt)") from None
        check_target(artifact.manifest.target, {"tensorrt": tensorrt.__version__, "gpu": gpu_architecture()}, "built")
        raise ArtifactError("running TensorRT engines is not implemented in this runner yet (see docs/gpu.md)")
