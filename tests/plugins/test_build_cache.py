"""plugins/build_cache.py: entries made once, whole, keyed by what decides them; no cache, no entry."""

from __future__ import annotations

import pytest

from plugins import build_cache


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_ENGINE_BUILDER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_an_entry_is_made_once_then_read(cache):
    made = []

    def make(path):
        made.append(path)
        path.write_text("made")

    first = build_cache.cached_file("things", "k1", "thing.txt", make)
    second = build_cache.cached_file("things", "k1", "thing.txt", make)
    assert first == second == cache / "things" / "k1" / "thing.txt"
    assert len(made) == 1 and first.read_text() == "made"
    assert [p.name for p in first.parent.iterdir()] == ["thing.txt"]  # the staging directory is gone


def test_a_failed_make_leaves_no_entry(cache):
    def make(path):
        path.write_text("half")
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        build_cache.cached_file("things", "k1", "thing.txt", make)
    assert list((cache / "things" / "k1").iterdir()) == []


def test_an_unwritable_cache_gives_no_entry(monkeypatch, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("LLM_ENGINE_BUILDER_CACHE_DIR", str(blocked))
    assert build_cache.cached_file("things", "k1", "thing.txt", lambda path: path.write_text("x")) is None


def test_the_default_place_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("LLM_ENGINE_BUILDER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build_cache.cache_dir() == tmp_path / "llm-engine-builder"


def test_keys_tell_apart_parts_that_concatenate_alike():
    assert build_cache.digest(["ab", "c"]) != build_cache.digest(["a", "bc"])
    assert build_cache.digest(["ab", b"c"]) == build_cache.digest([b"ab", "c"])


def test_a_file_in_a_key_stands_for_its_name_and_contents(tmp_path):
    source = tmp_path / "kernel.c"
    source.write_text("int x;\n")
    assert build_cache.digest([source]) == build_cache.digest(["kernel.c", b"int x;\n"])
    source.write_text("int y;\n")
    assert build_cache.digest([source]) != build_cache.digest(["kernel.c", b"int x;\n"])
