"""TensorRT backend: refuses, in one line, an engine this machine cannot run (no TensorRT, another TensorRT version
or another GPU than the engine was built for). Running TensorRT engines is not implemented in this runner yet:
TensorRT cannot be installed on the machines it was written on, so no engine was ever built to run."""

from __future__ import annotations

from engines.format import Artifact, ArtifactError


class TensorRTBackend:
    def __init__(self, artifact: Artifact) -> None:
        try:
            import tensorrt
        except ImportError:
            raise ArtifactError("this is a TensorRT engine: its runner needs tensorrt (pip install tensorrt)") from None
        import torch

        target = artifact.manifest.target
        here = {"tensorrt": tensorrt.__version__}
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            here["gpu"] = f"sm_{major}{minor}"
        for key, wanted in target.items():
            if here.get(key) != wanted:
                found = here.get(key, "none")
                raise ArtifactError(f"this engine was built for {key} {wanted}, this machine has {found}: rebuild it")
        raise ArtifactError("running TensorRT engines is not implemented in this runner yet (see docs/gpu.md)")
