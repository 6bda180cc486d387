"""Build options: defaults that depend on other options."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.build import BuildOptions


@pytest.mark.parametrize(
    "method, drafts, nodes", [("redrafter", 2, 1 + 2 * 2 + 4), ("prompt-lookup", 4, 5), ("draft-model", 4, 5)]
)
def test_draft_length_defaults_per_speculation_method(method, drafts, nodes):
    options = BuildOptions("default", Path("out"), speculative=method)
    assert options.draft_len == drafts
    assert options.tree_nodes == nodes


def test_an_explicit_draft_length_is_kept():
    assert BuildOptions("default", Path("out"), speculative="draft-model", draft_len=6).draft_len == 6
    assert BuildOptions("default", Path("out"), speculative="redrafter", draft_len=1).tree_nodes == 1 + 2 * 1 + 4
