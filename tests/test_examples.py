"""Every script in examples/ runs to the end on a tiny engine, so the examples stay true to the API."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script, engine_factory):
    engine = engine_factory("gqa", max_seq_len=512)  # room for a 3-turn chat in the tiny tokenizer's short tokens
    done = subprocess.run([sys.executable, str(script), str(engine)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_there_are_examples():
    assert len(EXAMPLES) >= 3
