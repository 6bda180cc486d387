"""diff_peers: two compare_peers results side by side, ratios the right way round, and warnings where runs differ."""

from __future__ import annotations

import json

from click.testing import CliRunner

from benchmarks.diff_peers import diff_report, improvement, main


def run(commit: str, bandwidth: float, ours_tok_s: float, ours_ttft_ms: float, machine: str = "CPU A") -> dict:
    prompt = {"decode_tok_s": ours_tok_s, "ttft_ms": ours_ttft_ms}
    return {
        "commit": commit,
        "machine": machine,
        "bandwidth_gbs": bandwidth,
        "versions": {"onnxruntime": "1.32.0"},
        "engines": {
            "ours int4": {"short": prompt, "long": prompt, "peak_rss_mb": 300.0, "perplexity": 13.7},
            f"peer {commit}": {"short": prompt, "long": prompt, "peak_rss_mb": 400.0},
        },
        "standing": [
            {
                "prompt": "short",
                "metric": "decode_tok_s",
                "ours": "ours int4",
                "peer": "peer",
                "ours_ahead_by": ours_tok_s / 100,
                "lowest": 0.8,
                "highest": 1.2,
                "rounds": 5,
            }
        ],
    }


def test_ratios_are_better_above_one_for_speeds_and_for_times():
    assert improvement(100, 110, higher_is_better=True) == 1.1
    assert improvement(100, 80, higher_is_better=False) == 1.25


def test_report_lists_shared_engines_and_the_paired_standings():
    text = "\n".join(diff_report(run("aaa", 20.0, 100.0, 80.0), run("bbb", 21.0, 110.0, 100.0)))
    assert "| ours int4 | 100 -> 110 (1.10x) | 100 -> 110 (1.10x) | 80 -> 100 (0.80x) |" in text
    assert "| 13.7 -> 13.7 (1.00x) |" in text  # perplexity where both have it; "-" where not
    assert (
        "| peer aaa" not in text and "only in the old run: peer aaa" in text and "only in the new run: peer bbb" in text
    )
    assert "| short | decode | ours int4 / peer | 1.00x (0.80-1.20) | ours int4 / peer | 1.10x (0.80-1.20) |" in text
    assert "bandwidth moved" not in text and "Different machines" not in text


def test_a_moved_bandwidth_and_another_machine_are_called_out():
    text = "\n".join(diff_report(run("aaa", 17.0, 100.0, 80.0), run("bbb", 25.0, 130.0, 70.0, machine="CPU B")))
    assert "bandwidth moved +47%" in text and "Different machines" in text


def test_a_file_that_is_not_a_result_is_refused_by_name(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(run("aaa", 20.0, 100.0, 80.0)))
    bad.write_text("{not json")
    result = CliRunner().invoke(main, [str(good), str(bad)])
    assert result.exit_code != 0 and "bad.json is not a compare_peers result" in result.output
    bad.write_text("[]")
    assert "no 'engines'" in CliRunner().invoke(main, [str(good), str(bad)]).output
    assert CliRunner().invoke(main, [str(good), str(good)]).exit_code == 0
