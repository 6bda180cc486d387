"""The default-model tests run on engines scripts/test.sh builds; under CI a missing one is a failure, not a skip."""

import pytest

from tests.conftest import prebuilt_engine


def test_a_missing_prebuilt_engine_fails_under_ci_and_skips_elsewhere(monkeypatch, tmp_path):
    monkeypatch.setenv("SOME_ENGINE_DIR", str(tmp_path))  # a directory with no manifest.json
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="SOME_ENGINE_DIR"):
        prebuilt_engine("SOME_ENGINE_DIR")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="SOME_ENGINE_DIR"):
        prebuilt_engine("SOME_ENGINE_DIR")
    (tmp_path / "manifest.json").write_text("{}")
    assert prebuilt_engine("SOME_ENGINE_DIR") == tmp_path
