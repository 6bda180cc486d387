"""What the tests of our kernels share: the kernel library, compiled once for the session (the build cache makes
the copies cheap)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugins import native_ops


@pytest.fixture(scope="session")
def library(tmp_path_factory) -> Path:
    """Our kernel library as a build ships it (skips where it cannot be compiled)."""
    if reason := native_ops.unavailable_reason():
        pytest.skip(f"our kernels cannot be built here: {reason}")
    return native_ops.compile_library(tmp_path_factory.mktemp("native_ops"))
