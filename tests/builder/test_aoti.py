"""The build's load check of an AOTInductor package (the engines themselves: tests/engines/backends/test_aoti.py)."""

from __future__ import annotations

import pytest

from builder import aoti


def test_a_package_the_loader_refuses_fails_the_build_naming_the_compiler(tmp_path):
    package = tmp_path / aoti.PACKAGE_FILE
    package.write_bytes(b"not a package")
    with pytest.raises(RuntimeError, match=r"does not load \(.+\); it was compiled with .+ \(CXX\)"):
        aoti.check_package_loads(package)


def test_a_loader_crash_is_reported_with_its_signal(tmp_path, monkeypatch):
    monkeypatch.setattr(aoti, "LOAD_CHECK", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(RuntimeError, match=r"does not load \(signal 11\)"):
        aoti.check_package_loads(tmp_path / aoti.PACKAGE_FILE)
