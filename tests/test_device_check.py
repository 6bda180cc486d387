"""scripts/device_check.py's stages run on CPU at tiny sizes, so the GPU run (a few minutes of a lent machine)
does not find a plumbing mistake first."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_check.py"


@pytest.fixture(scope="module")
def device_check():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_stage_builds_aoti_engines_equal_to_transformers(device_check, tmp_path):
    results = device_check.tiny_parity(tmp_path, device="cpu")
    assert results["fp32_greedy_identical_to_transformers"] is True
    assert len(results["int4_tokens"]) == 8


def test_timing_stage_reports_prefill_and_decode_rates(device_check, engine_factory):
    results = device_check.time_engine(engine_factory("gqa", backend="aoti"), 10**6, prompt_len=30, new_tokens=8)
    assert set(results) == {"prefill_30_s", "decode_b1_tok_s", "decode_b4_tok_s", "decode_b1_weight_gb_per_s",
                            "decode_b1_mbu", "cuda_graph_error"}  # fmt: skip
    assert results["decode_b1_tok_s"] > 0 and results["decode_b1_mbu"] is None  # (no GPU: no peak bandwidth)


def test_stage_records_an_error_and_the_check_goes_on(device_check):
    results = {}
    device_check.stage(results, "broken", lambda: 1 / 0)
    device_check.stage(results, "fine", lambda: {"ok": True})
    assert "ZeroDivisionError" in results["broken"]["error"] and results["fine"]["ok"] is True
