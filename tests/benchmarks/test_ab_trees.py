"""ab_trees on a tiny engine: both workers run, their rounds pair up, and two engines that answer differently are
refused (the comparison would mean nothing)."""

import json
from pathlib import Path

from click.testing import CliRunner

from benchmarks.ab_trees import main

ROOT = Path(__file__).resolve().parents[2]


def test_one_checkout_against_itself_pairs_its_rounds(engine_factory, tmp_path):
    engine = str(engine_factory())
    out = tmp_path / "ab.json"
    args = [
        "--before",
        str(ROOT),
        engine,
        "--after",
        str(ROOT),
        engine,
        "--runs",
        "2",
        "--threads",
        "1",
        "--long-prompt-tokens",
        "0",
    ]
    result = CliRunner().invoke(main, [*args, "--new-tokens", "8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "paired by round" in result.output
    report = json.loads(out.read_text())
    assert len(report["after"]["short"]["decode_tok_s_runs"]) == 2
    median, lowest, highest = report["short_after_over_before"]["decode"]
    assert lowest <= median <= highest


def test_engines_that_answer_differently_are_refused(engine_factory):
    args = ["--before", str(ROOT), str(engine_factory("gqa")), "--after", str(ROOT), str(engine_factory("mqa"))]
    result = CliRunner().invoke(
        main, [*args, "--runs", "1", "--threads", "1", "--new-tokens", "4", "--long-prompt-tokens", "0"]
    )
    assert result.exit_code != 0 and "answer the short prompt differently" in str(result.exception or result.output)
