"""The TensorRT backend's refusals, run here with a stand-in `tensorrt` module (TensorRT itself cannot be installed
on these machines): no TensorRT, another TensorRT version, another GPU, and running at all (not implemented)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from engines.backends.tensorrt import TensorRTBackend
from engines.format import Artifact, ArtifactError, open_artifact


def tensorrt_engine(engine_factory, target: dict) -> Artifact:
    artifact = open_artifact(engine_factory("gqa"))
    manifest = dataclasses.replace(artifact.manifest, backend="tensorrt", target=target)
    return Artifact(artifact.directory, manifest)


@pytest.fixture
def tensorrt_version(monkeypatch):
    def install(version: str | None) -> None:
        module = None if version is None else types.SimpleNamespace(__version__=version)
        monkeypatch.setitem(sys.modules, "tensorrt", module)

    return install


def test_without_tensorrt_the_engine_is_refused_saying_what_to_install(engine_factory, tensorrt_version):
    tensorrt_version(None)  # (a None entry makes the import fail)
    with pytest.raises(ArtifactError, match="needs tensorrt"):
        TensorRTBackend(tensorrt_engine(engine_factory, {"tensorrt": "11.4.0"}))


def test_another_tensorrt_or_gpu_is_refused_in_one_line(engine_factory, tensorrt_version):
    tensorrt_version("10.9.0")
    with pytest.raises(ArtifactError, match="built for tensorrt 11.4.0, this machine has 10.9.0"):
        TensorRTBackend(tensorrt_engine(engine_factory, {"tensorrt": "11.4.0"}))
    with pytest.raises(ArtifactError, match="built for gpu sm_10, this machine has (none|sm_)"):
        TensorRTBackend(tensorrt_engine(engine_factory, {"tensorrt": "10.9.0", "gpu": "sm_10"}))


def test_a_matching_engine_is_refused_because_running_it_is_not_implemented(engine_factory, tensorrt_version):
    tensorrt_version("10.9.0")
    with pytest.raises(ArtifactError, match="not implemented"):
        TensorRTBackend(tensorrt_engine(engine_factory, {"tensorrt": "10.9.0"}))
