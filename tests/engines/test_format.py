"""Opening an artifact validates it: damaged, foreign or future artifacts are refused with one clear message."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict

import pytest

from engines.format import (
    SCHEMA_VERSION,
    ArtifactError,
    GPTQFacts,
    KVCacheQuantization,
    PhaseSpec,
    QuantizationSpec,
    QuantMethod,
    SpeculationMethod,
    SpeculationSpec,
    open_artifact,
)
from plugins import native_ops


@pytest.fixture
def engine_copy(engine_factory, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(engine_factory("gqa"), copy)
    return copy


def test_a_fresh_build_opens_and_records_every_file(engine_copy):
    artifact = open_artifact(engine_copy)
    manifest = artifact.manifest
    assert manifest.schema_version == SCHEMA_VERSION
    # our kernels' library where this machine could compile it (plugins/native_ops.py)
    kernel = set() if native_ops.unavailable_reason() else {native_ops.LIBRARY_NAME}
    assert set(manifest.files) == {"model.onnx", "model.onnx.data", "sampler.onnx", "tokenizer.json"} | kernel
    assert manifest.graphs["step"].native_library == (native_ops.LIBRARY_NAME if kernel else None)
    assert {"prefill", "decode", "verify"} <= set(manifest.phases)
    # every phase runs the one graph, so the weights exist once on disk
    assert {p.graph for p in manifest.phases.values()} == {"step"}


def test_missing_directory(tmp_path):
    with pytest.raises(ArtifactError, match="engine not found"):
        open_artifact(tmp_path / "nope")


def test_directory_without_manifest(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"onnx?")
    with pytest.raises(ArtifactError, match="not an engine artifact"):
        open_artifact(tmp_path)


def test_unknown_schema_version(engine_copy):
    manifest = json.loads((engine_copy / "manifest.json").read_text())
    manifest["schema_version"] = SCHEMA_VERSION + 1
    (engine_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="schema version .* not supported"):
        open_artifact(engine_copy)


def test_corrupt_manifest(engine_copy):
    (engine_copy / "manifest.json").write_text("{ not json")
    with pytest.raises(ArtifactError, match="corrupt"):
        open_artifact(engine_copy)


def test_truncated_weights(engine_copy):
    data = engine_copy / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match="truncated"):
        open_artifact(engine_copy)


def test_flipped_byte_in_weights(engine_copy):
    data = engine_copy / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        open_artifact(engine_copy)


def test_missing_graph_file(engine_copy):
    (engine_copy / "model.onnx").unlink()
    with pytest.raises(ArtifactError, match="missing"):
        open_artifact(engine_copy)


def test_foreign_backend_is_refused_by_the_runner(engine_copy):
    from engines.backends import open_backend

    manifest = json.loads((engine_copy / "manifest.json").read_text())
    manifest["backend"] = "tensorrt-9000"
    (engine_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="not available"):
        open_backend(open_artifact(engine_copy))


def test_a_phase_describes_its_buckets_as_ranges():
    prefill = PhaseSpec("prefill", "step", [1], list(range(1, 1025)), [64, 128, 2048], "last")
    assert prefill.describe() == (
        "graph step, rows 1, tokens per row 1..1024 (1024 buckets), kv 64..2048 (3 buckets), logits last"
    )


def test_typed_sections_round_trip_through_json_and_report_what_is_set():
    quantization = QuantizationSpec(
        QuantMethod.GPTQ,
        bits=4,
        group_size=32,
        gptq=GPTQFacts(0.1, True, True, "text.txt: 4 x 16 tokens"),
        kv_cache=KVCacheQuantization("int8", "static", "text.txt: 2 x 64 tokens"),
    )
    speculation = SpeculationSpec(SpeculationMethod.REDRAFTER, 2, 9, beam_width=2, graph="draft", head={"epochs": 1})
    for spec in (quantization, speculation):
        assert type(spec).from_dict(json.loads(json.dumps(asdict(spec)))) == spec
    assert json.loads(json.dumps(asdict(quantization)))["method"] == "gptq"
    assert QuantizationSpec().facts() == {"method": QuantMethod.NONE}
    assert quantization.facts()["gptq"]["damping"] == 0.1 and "linears_kept" not in quantization.facts()
    assert "head" not in speculation.facts() and speculation.facts()["graph"] == "draft"
    with pytest.raises(ValueError, match="'rtn4'"):
        QuantizationSpec.from_dict({"method": "rtn4"})


def test_a_heads_expected_tokens_per_verify_step_is_read_for_the_engines_tree_shape():
    record = {"validation_tokens_per_step": {"beams2_len2": 1.88, "beams3_len4": 2.17}}
    two_by_two, two_by_three = (
        SpeculationSpec(SpeculationMethod.REDRAFTER, draft_len=k, max_tree_nodes=9, beam_width=2, head=record)
        for k in (2, 3)
    )
    assert two_by_two.head_tokens_per_verify() == 1.88 and two_by_three.head_tokens_per_verify() is None
    assert SpeculationSpec(SpeculationMethod.PROMPT_LOOKUP, 4, 5).head_tokens_per_verify() is None
