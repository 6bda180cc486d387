"""Build options: defaults that depend on other options."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.build import BuildOptions, default_prefill_chunk


@pytest.mark.parametrize("method, drafts, nodes", [("redrafter", 2, 1 + 2 * 2 + 4), ("prompt-lookup", 4, 5), ("draft-model", 4, 5)])
def test_draft_length_defaults_per_speculation_method(method, drafts, nodes):
    options = BuildOptions("default", Path("out"), speculative=method)
    assert options.draft_len == drafts
    assert options.tree_nodes == nodes


def test_an_explicit_draft_length_is_kept():
    assert BuildOptions("default", Path("out"), speculative="draft-model", draft_len=6).draft_len == 6
    assert BuildOptions("default", Path("out"), speculative="redrafter", draft_len=1).tree_nodes == 1 + 2 * 1 + 4


def test_the_largest_prefill_chunk_is_long_unless_the_kv_cache_is_int8():
    # one long chunk reads the weights once; onnxruntime's int8-cache attention slows down with the chunk's length
    assert default_prefill_chunk("auto", 2048) == 1024
    assert default_prefill_chunk("auto", 256) == 256
    assert default_prefill_chunk("int8", 2048) == 128
