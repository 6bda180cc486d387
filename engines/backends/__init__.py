"""Backends execute one phase graph of an artifact. Each imports its runtime lazily and fails with a clear reason."""

from __future__ import annotations

from engines.format import Artifact, ArtifactError


def open_backend(artifact: Artifact, threads: int | None = None, profile_prefix: str | None = None):
    backend = artifact.manifest.backend
    if backend == "onnxruntime":
        from engines.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(artifact, threads=threads, profile_prefix=profile_prefix)
    if backend == "aoti":
        from engines.backends.aoti import AOTInductorBackend

        return AOTInductorBackend(artifact, threads=threads, profile_prefix=profile_prefix)
    if backend == "tensorrt":
        from engines.backends.tensorrt import TensorRTBackend

        return TensorRTBackend(artifact)
    raise ArtifactError(
        f"engine backend {backend!r} is not available in this runner (available: onnxruntime, aoti, tensorrt)"
    )
