"""What a compiled step graph was built for (the manifest's `target`: torch, GPU architecture, TensorRT version)
and the check a runner makes against this machine before it loads one. torch is imported only when asked for."""

from __future__ import annotations

from engines.format import ArtifactError


def torch_version() -> str:
    """torch's release, without its build tag ("2.11.0", not "2.11.0+cu130")."""
    import torch

    return torch.__version__.split("+")[0]


def gpu_architecture() -> str | None:
    """This machine's CUDA device as "sm_XY" (its compute capability), or None where there is none."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def check_target(target: dict[str, str], here: dict[str, str | None], made: str) -> None:
    """Refuse, in one line, an engine `made` ("compiled", "built") for other facts than this machine's `here` (a
    fact the machine lacks is None); facts `here` does not name are not compared."""
    for key, wanted in target.items():
        if key in here and here[key] != wanted:
            found = here[key] or "none"
            raise ArtifactError(f"this engine was {made} for {key} {wanted}, this machine has {found}: rebuild it here")
