import json

import pytest

from benchmarks.compare_peers import check_agreement, engine_label, standing
from benchmarks.interleave import paired_ratio


def test_paired_ratio_compares_round_by_round():
    # the machine slows down in round 2 for both engines: round by round ours is 1.1x every time, while the ratio
    # of medians (110 / 100... or 55 / 100) depends on which slow and fast runs the medians pick
    ours = [110.0, 55.0, 110.0]
    peer = [100.0, 50.0, 100.0]
    median, low, high = paired_ratio(ours, peer)
    assert median == pytest.approx(1.1) and low == pytest.approx(1.1) and high == pytest.approx(1.1)
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])


def _engine(short_decode, long_decode, short_ttft, long_ttft):
    def prompt(decode, ttft):
        return {
            "decode_tok_s": sorted(decode)[len(decode) // 2],
            "decode_tok_s_runs": decode,
            "ttft_ms": sorted(ttft)[len(ttft) // 2],
            "ttft_ms_runs": ttft,
        }

    return {"short": prompt(short_decode, short_ttft), "long": prompt(long_decode, long_ttft)}


def test_standing_picks_the_best_of_each_side_and_says_who_is_ahead():
    engines = {
        "ours fp32": _engine([30, 30, 30], [28, 28, 28], [90, 90, 90], [1500, 1500, 1500]),
        "ours int4 rtn g32": _engine([110, 120, 100], [75, 80, 70], [80, 85, 90], [1600, 1650, 1550]),
        "ort-genai int4": _engine([100, 100, 100], [80, 80, 80], [100, 100, 100], [2000, 2000, 2000]),
        "llama.cpp Q4_1 (the GGUF)": _engine([90, 90, 90], [70, 70, 70], [120, 120, 120], [2500, 2500, 2500]),
    }
    rows = {(r["prompt"], r["metric"]): r for r in standing(engines)}
    short_decode = rows["short", "decode_tok_s"]
    assert (short_decode["ours"], short_decode["peer"]) == ("ours int4 rtn g32", "ort-genai int4")
    assert short_decode["ours_ahead_by"] == pytest.approx(1.1)
    assert (short_decode["lowest"], short_decode["highest"]) == (pytest.approx(1.0), pytest.approx(1.2))
    assert rows["long", "decode_tok_s"]["ours_ahead_by"] == pytest.approx(75 / 80)  # behind: below 1
    # TTFT: lower is better, so ours ahead means the peer's time over ours
    long_ttft = rows["long", "ttft_ms"]
    assert long_ttft["ours"] == "ours fp32" and long_ttft["ours_ahead_by"] == pytest.approx(2000 / 1500)
    assert rows["short", "ttft_ms"]["ours"] == "ours int4 rtn g32"


def test_engine_label_names_an_int8_kv_cache_and_onnxruntimes_own_kernels(tmp_path):
    def label(kv_dtype: str, quantization: dict, step: dict) -> str:
        manifest = {
            "dtype": "fp32",
            "kv_cache": {"dtype": kv_dtype},
            "quantization": quantization,
            "graphs": {"step": step},
            "phases": {"decode": {"graph": "step"}},
        }
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
        return engine_label(tmp_path)

    int4 = {"method": "rtn", "bits": 4, "group_size": 32}
    both = {"native_library": "libnative_ops.so", "native_ops": ["DecodeAttention", "Int4MatMul"]}
    assert label("float32", int4, both) == "ours int4 rtn g32"
    assert (
        label("int8", int4, {"native_library": "libnative_ops.so", "native_ops": ["Int4MatMul"]})
        == "ours int4 rtn g32, int8 KV cache"
    )
    assert (
        label("float32", int4, {"native_library": None, "native_ops": []})
        == "ours int4 rtn g32, onnxruntime attention, onnxruntime matmul"
    )
    assert (
        label(
            "float32",
            {"method": "none", "bits": None},
            {"native_library": "libnative_ops.so", "native_ops": ["DecodeAttention"]},
        )
        == "ours fp32"
    )


def test_fp32_engines_must_agree_on_first_tokens_and_perplexity_quantized_ones_are_reported():
    def engine(short, long, perplexity):
        return {"short": {"first_tokens": short}, "long": {"first_tokens": long}, "perplexity": perplexity}

    results = {
        "ours fp32": engine([1, 2], [3, 4], 10.20),
        "ort-genai fp32": engine([1, 2], [3, 4], 10.21),
        "transformers fp32 eager": engine([1, 2], [3, 4], 10.60),  # same tokens, but scored 4% apart: a broken harness
        "ours int4 rtn g32": engine([1, 5], [3, 4], 13.7),  # quantized: differences are reported only
    }
    assert check_agreement(results, "ours fp32") == ["transformers fp32 eager"]
    assert results["ours int4 rtn g32"]["agreement"] == "no (short)"
    assert results["ort-genai fp32"]["agreement"] == "yes"
    results["ort-genai fp32"]["long"]["first_tokens"] = [3, 9]
    assert check_agreement(results, "ours fp32") == ["ort-genai fp32", "transformers fp32 eager"]
