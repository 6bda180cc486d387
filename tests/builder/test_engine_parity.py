"""Engines built from tiny random checkpoints against Hugging Face transformers on the same weights."""

from __future__ import annotations

import numpy as np
import pytest

from runner import LLM, SamplingParams
from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from tests.reference import load_reference, reference_greedy, reference_logits
from tests.tiny_checkpoint import CONFIGS

TEXT = "The quick brown fox jumps over the lazy dog."
LONG_TEXT = "Speculative decoding drafts tokens and verifies them in one pass. " * 2
# every architecture the tiny checkpoints cover; "k_quants" is gqa at the widths GGUF K-quants need, made for the
# GGUF block tests (its 4x wider fp32 sums round past this file's tolerance, and it adds no code path here)
ARCHITECTURES = sorted(name for name in CONFIGS if name != "k_quants")


def assert_logits_close(ours: np.ndarray, reference: np.ndarray) -> None:
    scale = max(1.0, float(np.abs(reference).max()))
    np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_prefill_and_20_decode_steps_match_transformers(name, engine_factory, checkpoint_factory):
    engine = LLMEngine(EngineArgs(engine_factory(name)))
    reference = load_reference(checkpoint_factory(name))
    executor = engine.executor
    tokens = engine.codec.encode(TEXT)

    logits = executor.prefill(0, tokens, 0).logits
    assert_logits_close(logits, reference_logits(reference, tokens)[-1])
    for _ in range(20):
        tokens.append(int(np.argmax(logits)))
        logits = executor.decode([0], [tokens[-1]], [len(tokens) - 1]).logits[0]
        assert_logits_close(logits, reference_logits(reference, tokens)[-1])


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_32_tokens_identical_to_transformers(name, engine_factory, checkpoint_factory):
    llm = LLM(engine_factory(name))
    prompt = llm.tokenizer.encode(TEXT)
    out = llm.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    )[0]
    assert out.token_ids == reference_greedy(load_reference(checkpoint_factory(name)), prompt, 32)
    assert out.finish_reason == "length"


def test_alone_batched_and_chunked_prefill_give_the_same_tokens(engine_factory, checkpoint_factory):
    # prefill chunks of 16 tokens: the long prompt takes several chunks, interleaved with the others' decoding
    llm = LLM(engine_factory("gqa", prefill_chunk=16))
    prompts = [llm.tokenizer.encode(t) for t in (LONG_TEXT, "hello", TEXT, "0123456789 hello world")]
    assert len(prompts[0]) > 2 * 16
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert batched == alone
    reference = load_reference(checkpoint_factory("gqa"))
    assert alone[0] == reference_greedy(reference, prompts[0], 24)


def two_prefilled_rows(engine_factory, checkpoint_factory, rows: tuple[int, int]):
    """An engine whose cache rows hold TEXT and its first 7 tokens, and the reference model of the same weights."""
    engine = LLMEngine(EngineArgs(engine_factory("gqa")))
    prompt = engine.codec.encode(TEXT)
    other = prompt[:7]
    engine.executor.prefill(rows[0], prompt, 0)
    engine.executor.prefill(rows[1], other, 0)
    return engine, load_reference(checkpoint_factory("gqa")), prompt, other


def test_verify_phase_scores_chains_and_trees_in_one_batch_like_the_reference(engine_factory, checkpoint_factory):
    engine, reference, prompt, other = two_prefilled_rows(engine_factory, checkpoint_factory, (0, 1))
    executor = engine.executor

    chain = [5, 17, 42, 9]
    chain_mask = np.tril(np.ones((4, 4), dtype=bool))
    # a tree: root 5 with two children 17 and 42; 9 follows 42
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=bool)
    verified = executor.verify([0, 1], [(chain, chain_mask), (chain, tree)], [len(prompt), len(other)])
    assert_logits_close(verified.logits[0], reference_logits(reference, prompt + chain)[len(prompt) :])
    assert_logits_close(verified.logits[1, 1], reference_logits(reference, other + [5, 17])[-1])
    assert_logits_close(verified.logits[1, 3], reference_logits(reference, other + [5, 42, 9])[-1])
    assert (verified.argmax == verified.logits.argmax(-1)).all()  # the graph's own argmax output

    # keep only the path 5 -> 42 -> 9 of row 1; the next token then sees exactly that history
    executor.commit(1, len(other), [0, 2, 3])
    decoded = executor.decode([1], [11], [len(other) + 3])
    assert_logits_close(decoded.logits[0], reference_logits(reference, other + [5, 42, 9, 11])[-1])
    assert decoded.argmax.tolist() == [int(np.argmax(decoded.logits[0]))]


def test_extend_appends_chains_of_different_lengths_and_scores_each_rows_last_token(engine_factory, checkpoint_factory):
    engine, reference, prompt, other = two_prefilled_rows(engine_factory, checkpoint_factory, (0, 2))
    executor = engine.executor

    extended = executor.extend([0, 2], [[5, 17], [42]], [len(prompt), len(other)])
    assert extended.logits.shape == (2, engine.artifact.manifest.model.vocab_size)
    assert_logits_close(extended.logits[0], reference_logits(reference, prompt + [5, 17])[-1])
    assert_logits_close(extended.logits[1], reference_logits(reference, other + [42])[-1])
    assert extended.argmax.tolist() == extended.logits.argmax(-1).tolist()
    # both tokens of row 0 are in its cache: the next one sees them
    decoded = executor.decode([0], [9], [len(prompt) + 2])
    assert_logits_close(decoded.logits[0], reference_logits(reference, prompt + [5, 17, 9])[-1])
