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
    # DEADLINE is the GPU lease's (470 s from import); here the stages run on CPU one test after another, and a slow
    # moment of a shared CI machine must not kill a compile that would have finished
    module.DEADLINE = module.time.monotonic() + 3600
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


def test_a_stage_past_the_deadline_is_recorded_as_skipped(device_check, monkeypatch):
    monkeypatch.setattr(device_check, "DEADLINE", device_check.time.monotonic() + 5)
    results = {}
    device_check.stage(results, "long", lambda: {"ran": True}, needs=60)
    assert "skipped" in results["long"] and "ran" not in results["long"]


def test_background_build_gives_the_engine_or_its_log(device_check, checkpoint_factory, tmp_path):
    engine, seconds = device_check.finish_build(
        device_check.start_build(checkpoint_factory("gqa"), tmp_path / "e", "cpu", max_seq_len=64)
    )
    assert (engine / "manifest.json").is_file() and seconds > 0
    broken = device_check.start_build(tmp_path / "missing", tmp_path / "f", "cpu")
    with pytest.raises(RuntimeError, match="the build failed"):
        device_check.finish_build(broken)


def test_an_isolated_stage_that_dies_is_a_result_with_its_traceback(device_check, tmp_path):
    results = device_check.isolated("time", str(tmp_path / "no-engine"), "1")
    assert results["error"].startswith("exit") and "Traceback" in results["log_tail"]


def test_an_isolated_stage_returns_its_result_with_and_without_cuda_graphs(device_check, tmp_path):
    first = device_check.isolated("tiny", str(tmp_path), "none")
    again = device_check.isolated("tiny", str(tmp_path), "none", eager=True)  # the engine built by the first
    assert first == again == {"fp32_greedy_identical_to_transformers": True, "cuda_graph_error": None}


def test_a_crash_excerpt_keeps_the_traceback_and_the_error_before_it(device_check):
    log = "noise\n" * 2000 + "Exception in aoti_torch: bad pointer\nFatal Python error: Segmentation fault\n  File x\n"
    excerpt = device_check.crash_excerpt(log + "Extension modules: " + "m, " * 5000)
    assert "bad pointer" in excerpt and "File x" in excerpt and "Extension modules" not in excerpt


def test_aoti_smoke_compiles_and_loads_a_package_with_this_machines_compiler(device_check):
    results = device_check.aoti_smoke()
    assert results["cpu_g++"] == "ok" and results["g++"].startswith("g++")
