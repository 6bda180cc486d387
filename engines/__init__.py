"""The engine artifact format and the backends that execute its graphs. Imports neither builder nor runner."""

from engines.format import Artifact, ArtifactError, Manifest, open_artifact

__all__ = ["Artifact", "ArtifactError", "Manifest", "open_artifact"]
