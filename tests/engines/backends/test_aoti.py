"""AOTInductor engines (builder build --backend aoti) of tiny checkpoints: the same contract as the ONNX engines,
so the same runner, API and server drive them; greedy tokens equal transformers' and the ONNX engine's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from engines.format import ArtifactError, open_artifact
from runner import LLM, SamplingParams
from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from tests.reference import load_reference, reference_greedy, reference_logits
from tests.runner.serving.test_server import MODEL, LiveServer

TEXT = "The quick brown fox jumps over the lazy dog."
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def aoti_engine(engine_factory):
    return engine_factory("gqa", backend="aoti")


def test_manifest_names_the_package_and_what_it_was_compiled_for(aoti_engine):
    manifest = open_artifact(aoti_engine).manifest
    assert manifest.backend == "aoti" and manifest.device == "cpu"
    assert manifest.graphs["step"].file == "model.pt2" and manifest.graphs["sampler"].file.endswith(".onnx")
    assert set(manifest.target) == {"torch"}
    # the same inputs and outputs as the ONNX step graph
    names = [t.name for t in manifest.graphs["step"].inputs], [t.name for t in manifest.graphs["step"].outputs]
    assert names[0][:6] == ["input_ids", "positions", "past_lens", "query_lens", "attention_bias", "logits_index"]
    assert names[1][:3] == ["logits", "argmax", "hidden"] and names[1][3] == "present_key.0"


def test_prefill_and_decode_logits_match_transformers(aoti_engine, checkpoint_factory):
    engine = LLMEngine(EngineArgs(aoti_engine))
    reference = load_reference(checkpoint_factory("gqa"))
    tokens = engine.codec.encode(TEXT)
    logits = engine.executor.prefill(0, tokens, 0).logits
    for _ in range(8):
        expected = reference_logits(reference, tokens)[-1]
        np.testing.assert_allclose(logits, expected, rtol=0, atol=2e-5 * max(1.0, float(np.abs(expected).max())))
        tokens.append(int(np.argmax(logits)))
        logits = engine.executor.decode([0], [tokens[-1]], [len(tokens) - 1]).logits[0]


def test_greedy_tokens_equal_transformers_and_the_onnx_engine_alone_and_batched(
    aoti_engine, engine_factory, checkpoint_factory
):
    aoti, onnx = LLM(aoti_engine), LLM(engine_factory("gqa"))
    prompts = [aoti.tokenizer.encode(t) for t in (TEXT, "hello", "0123456789 hello world " * 3)]
    ours = [o.token_ids for o in aoti.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert ours == [o.token_ids for o in onnx.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert ours[0] == reference_greedy(load_reference(checkpoint_factory("gqa")), prompts[0], 24)
    alone = [aoti.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0].token_ids for p in prompts]
    assert alone == ours


def test_served_by_the_openai_server(aoti_engine, engine_factory):
    answers = []
    for engine in (aoti_engine, engine_factory("gqa")):
        live = LiveServer(engine)
        try:
            messages = [{"role": "user", "content": "hello"}]
            reply = live.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
            chunks = live.client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert streamed == reply.choices[0].message.content
            answers.append(reply.choices[0].message.content)
        finally:
            live.stop()
    assert answers[0] == answers[1]


def test_a_package_built_for_another_torch_is_refused_in_one_line(aoti_engine, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(aoti_engine, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["target"]["torch"] = "1.0.0"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="compiled for torch 1.0.0, this machine has"):
        LLM(copy)


def test_int4_engine_runs_the_blockwise_op_and_agrees_with_the_float_compute_onnx_engine(engine_factory):
    """On CPU the package computes the op's reference (dequantize, then matmul), as the manifest says; its greedy
    tokens equal those of the ONNX int4 engine of the same blocks with float activations."""
    engine = engine_factory("gqa", backend="aoti", quant="int4")
    quantization = open_artifact(engine).manifest.quantization
    assert quantization.op.startswith("plugins::blockwise_matmul as dequantize + matmul")
    assert quantization.accuracy_level is None
    import torch

    # the package holds the blocks, not float weights folded from them at compile time
    constants = torch._inductor.aoti_load_package(str(engine / "model.pt2")).get_constant_fqns()
    assert any(name.endswith("qkv_proj.qweight") for name in constants)
    assert not any(name.endswith("proj.weight") for name in constants)
    aoti, onnx = LLM(engine), LLM(engine_factory("gqa", quant="int4", int8_compute=False))
    prompts = [aoti.tokenizer.encode(t) for t in (TEXT, "hello")]
    ours = [o.token_ids for o in aoti.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert ours == [o.token_ids for o in onnx.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


def test_inputs_that_disagree_are_refused_before_the_compiled_graph_runs(aoti_engine):
    """The package checks nothing itself (a mismatch would read or write out of bounds)."""
    executor = LLMEngine(EngineArgs(aoti_engine)).executor
    bound = executor.backend.bind("step", executor._cache_buffers(0, 2))
    feeds = {
        "input_ids": np.zeros((3, 1), np.int64),  # three rows against a cache of two
        "positions": np.zeros((3, 1), np.int64),
        "past_lens": np.zeros(3, np.int64),
        "query_lens": np.ones(3, np.int64),
        "attention_bias": np.zeros((3, 1, 1, 1), np.float32),
        "logits_index": np.zeros((3, 1), np.int64),
    }
    with pytest.raises(ValueError, match="past_key.0 has shape"):
        bound.run(feeds, executor._output_arrays(3, 1))
    with pytest.raises(ValueError, match="cache rows 4..4 do not exist"):
        executor.prefill(executor.cache.rows, [1, 2, 3], 0)


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_a_runner_process_without_the_builder_runs_the_package(engine_factory, quant):
    """The package calls no op defined in Python (the builder's plugins are not imported where the runner runs),
    and answers as the building process does."""
    engine = engine_factory("gqa", backend="aoti", quant=quant)
    script = (
        "import sys; from runner import LLM, SamplingParams; "
        f"llm = LLM({str(engine)!r}); "
        "out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=8, "
        "temperature=0.0, ignore_eos=True))[0]; "
        "assert not any(m == 'plugins' or m.startswith(('plugins.', 'builder')) for m in sys.modules), 'imported'; "
        "print(out.token_ids)"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    expected = LLM(engine).generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)[0].token_ids[:8]
    assert run.stdout.strip().splitlines()[-1] == str(expected)


@pytest.mark.parametrize("stop_each_call", [True, False], ids=["stops checked per call", "stops checked at the end"])
def test_device_greedy_loop_gives_the_host_loops_tokens_and_stops_where_it_does(
    aoti_engine, engine_factory, stop_each_call
):
    """The AOTInductor backend's greedy loop (state kept on its device) against the onnxruntime engine's host loop:
    the same tokens for rows of different lengths, and the same cut at the first stop token, whether the loop
    checks for stops after each call (CPU) or once after the last (CUDA)."""
    loops = [LLMEngine(EngineArgs(e)).executor for e in (aoti_engine, engine_factory("gqa"))]
    device_loop = loops[0]._greedy_loops[0, 2] = loops[0]._greedy_loop(0, 2)
    device_loop.stop_each_call = stop_each_call
    prompts = [[5, 6, 7, 8], [9, 10]]
    results = []
    for executor in loops:
        for row, prompt in enumerate(prompts):
            executor.prefill(row, prompt, 0)
        stop = np.zeros(320, bool)  # the tiny vocabulary
        free = executor.decode_greedy([0, 1], [11, 12], [4, 2], 12, stop)
        for row, prompt in enumerate(prompts):
            executor.prefill(row, prompt, 0)
        stop[free[1, 5]] = True  # row 1's sixth token stops both rows there (or earlier, where row 0 meets it)
        results.append((free, executor.decode_greedy([0, 1], [11, 12], [4, 2], 12, stop)))
    (aoti_free, aoti_stopped), (onnx_free, onnx_stopped) = results
    assert type(device_loop).__name__ == "DeviceGreedyLoop"
    np.testing.assert_array_equal(aoti_free, onnx_free)
    np.testing.assert_array_equal(aoti_stopped, onnx_stopped)
    assert aoti_stopped.shape[1] <= 5


def test_a_draft_model_engine_drafts_with_an_engine_of_the_same_backend(engine_factory):
    """Speculation through the AOTInductor step graph (verify trees, the cache's kept nodes): greedy output is the
    plain engine's, and the draft model is compiled by the same backend."""
    engine = engine_factory("gqa", prefill_chunk=8, draft_model="mqa", draft_len=3, backend="aoti")
    assert open_artifact(engine / "draft").manifest.backend == "aoti"
    spec = LLM(engine, speculative_max_rows=None)
    prompts = [spec.tokenizer.encode(t) for t in (TEXT, "hello hello hello hello")]
    expected = [o.token_ids for o in LLM(engine_factory("gqa", backend="aoti")).generate(
        prompt_token_ids=prompts, sampling_params=GREEDY)]  # fmt: skip
    assert [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=GREEDY)] == expected
    assert spec.engine.speculation_stats.verify_steps > 0


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(backend="aoti", quant="int4", group_size=16), "int4 kernel takes groups of 32 or more, not 16"),
        (dict(backend="onnxruntime", device="cuda"), "--device is the torch backends' choice"),
        (dict(backend="tvm"), "unknown backend 'tvm'"),
    ],
)
def test_builds_a_backend_cannot_make_are_refused_before_any_work(checkpoint_factory, tmp_path, options, message):
    from builder.build import BuildOptions, build_engine

    with pytest.raises(ValueError, match=message):
        build_engine(BuildOptions(str(checkpoint_factory("gqa")), tmp_path / "engine", **options))
    assert not (tmp_path / "engine").exists()
