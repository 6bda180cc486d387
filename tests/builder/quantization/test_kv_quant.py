"""The int8 KV cache: calibrated scales, the engine against its own int8 reference and against the float cache."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from tokenizers import Tokenizer

from builder.build import BuildOptions, build_engine
from builder.loaders import load_checkpoint
from builder.quantization.kv_quant import KVCalibration, calibrate_kv_scales, calibration_windows
from builder.weights import load_model
from engines.format import open_artifact
from plugins import native_ops
from runner import LLM, SamplingParams
from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from tests.builder.test_quantized_engine import TEXT, teacher_forced_logits

MAX_SEQ_LEN = 256  # the engine_factory default


def float_model_and_scales(checkpoint_dir):
    checkpoint = load_checkpoint(checkpoint_dir)
    model = load_model(checkpoint.config, checkpoint.read_tensors(), torch.float32, max_positions=2 * MAX_SEQ_LEN)
    tokenizer = Tokenizer.from_str(checkpoint.tokenizer.tokenizer_json)
    windows = calibration_windows(lambda text: tokenizer.encode(text).ids, KVCalibration(), MAX_SEQ_LEN)
    return model, calibrate_kv_scales(model, windows), windows


def run(model, tokens: list[int], start: int = 0):
    """One prefill of `tokens` at rotary positions start.. -> (logits of every token, keys, values)."""
    config, steps = model.config, len(tokens)
    cache = [
        torch.zeros(1, config.num_kv_heads, steps, config.head_dim, dtype=model.kv_cache_dtype)
    ] * config.num_layers
    with torch.no_grad():
        out = model(
            torch.tensor([tokens]),
            torch.arange(start, start + steps)[None],
            torch.tensor([0]),
            torch.tensor([steps]),
            torch.zeros(1, 1, steps, steps),
            torch.arange(steps)[None],
            cache,
            cache,
        )
    return out[0][0].numpy(), out[3 : 3 + config.num_layers], out[3 + config.num_layers :]


def test_key_scales_bound_positions_calibration_never_reached(checkpoint_factory):
    """K is cached after the rotary turn: the pair-norm scales hold wherever the same tokens sit."""
    model, scales, windows = float_model_and_scales(checkpoint_factory("gqa"))
    _, keys, values = run(model, windows[0].tolist(), start=MAX_SEQ_LEN)  # positions calibration never ran at
    for (k_scale, v_scale), k, v in zip(scales, keys, values):
        assert (k.abs() <= 127 * k_scale * (1 + 1e-4)).all()
        assert (v.abs() <= 127 * v_scale * (1 + 1e-4)).all()
    # and they are tight: some channel of every layer reaches its scale's end
    assert all(((k.abs() / (127 * s)).amax() > 0.5) for (s, _), k in zip(scales, keys))


def test_int8_cache_engine_computes_its_int8_reference_and_stays_close_to_the_float_cache(
    engine_factory, checkpoint_factory
):
    path = engine_factory("gqa", kv_cache_dtype="int8")
    manifest = open_artifact(path).manifest
    assert manifest.kv_cache.dtype == "int8" and manifest.quantization.kv_cache.dtype == "int8"
    graph = onnx.load(str(path / "model.onnx"), load_external_data=False).graph
    if native_ops.unavailable_reason() is None:  # our attention kernel, its int8-cache form
        assert manifest.graphs["step"].native_ops == ["DecodeAttention", "ArgMax", "SkipRmsNorm"]
        attention = [n for n in graph.node if n.op_type == "DecodeAttentionInt8Cache"]
        assert attention and not [n for n in graph.node if "Attention" in n.op_type and n not in attention]
    else:
        attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
        assert attention and all(
            {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}["kv_cache_bit_width"] == 8
            for n in attention
        )

    engine, float_engine = LLMEngine(EngineArgs(path)), LLMEngine(EngineArgs(engine_factory("gqa")))
    prompt = engine.codec.encode(TEXT)
    forced = engine.codec.encode(" and then the fox sleeps in the sun")
    ours = teacher_forced_logits(engine, prompt, forced)
    # the torch reference with the same calibration and an int8 cache: the same numbers
    model, scales, _ = float_model_and_scales(checkpoint_factory("gqa"))
    model.use_int8_kv_cache(scales)
    reference = run(model, prompt + forced)[0][len(prompt) - 1 :]
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-4 * np.abs(reference).max())  # measured 1.6e-6
    # against the float cache, for this deliberately sharp random model: measured 22/22 argmax equal, 6.5% of the
    # largest logit
    exact = teacher_forced_logits(float_engine, prompt, forced)
    assert (ours.argmax(-1) == exact.argmax(-1)).mean() >= 0.75
    assert np.abs(ours - exact).max() <= 0.1 * np.abs(exact).max()


def test_int8_cache_greedy_tokens_do_not_depend_on_the_batch(engine_factory):
    llm = LLM(engine_factory("gqa", kv_cache_dtype="int8"))
    prompts = [llm.tokenizer.encode(t) for t in (TEXT, "hello", "0123456789 hello world", TEXT[::-1])]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)] == alone


def test_unknown_kv_cache_dtype_is_refused(tmp_path, checkpoint_factory):
    with pytest.raises(ValueError, match="KV cache dtype"):
        build_engine(BuildOptions(str(checkpoint_factory("gqa")), tmp_path / "e", kv_cache_dtype="fp8"))
