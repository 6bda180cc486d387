"""Prompt logprobs (vLLM's prompt_logprobs; the server's echo + logprobs) against transformers on the same weights."""

from __future__ import annotations

import numpy as np
import pytest

from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from runner.core.request import request_output
from runner.sampling.logprobs import log_softmax, token_logprobs
from runner.sampling.params import SamplingParams
from tests.reference import load_reference, reference_logits

# ~70 tokens: three prompt chunks of the test engines (prefill chunk 32)
TEXT = (
    "Speculative decoding drafts tokens and verifies them in one pass; the quick brown fox jumps over the lazy dog. "
    * 2
)


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    requests = engine.new_requests(None, prompt, params)
    for request in requests:
        engine.add(request)
    while not all(r.finished for r in requests):
        engine.step()
    return [request_output([r]) for r in requests]  # each completion on its own


def test_prompt_logprobs_match_transformers_across_chunks_forks_and_the_prefix_cache(
    engine_factory, checkpoint_factory
):
    engine = LLMEngine(EngineArgs(engine_factory("gqa"), enable_prefix_caching=True))
    prompt = engine.codec.encode(TEXT)
    assert len(prompt) > 2 * engine.executor.max_chunk
    expected = log_softmax(reference_logits(load_reference(checkpoint_factory("gqa")), prompt))

    first, fork = run(engine, prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, n=2))
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(prompt)
    for position, entry in enumerate(first.prompt_logprobs[1:], start=1):
        row = expected[position - 1]  # the logits after the tokens before it
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(row[prompt[position]], abs=1e-4)
        assert [t for t, _ in entry.top] == list(np.argsort(-row, kind="stable")[:3])
        own = row[prompt[position]]  # its rank: 1 + the tokens likelier than it (ties within rounding either way)
        assert 1 + (row > own + 1e-4).sum() <= entry.rank <= 1 + (row > own - 1e-4).sum()
        assert [v for _, v in entry.top] == pytest.approx(np.sort(row)[::-1][:3], abs=1e-4)
    assert fork.prompt_logprobs == first.prompt_logprobs  # the fork shares the computed prompt
    # the same prompt again: the prefix cache holds it, but logits are not cached, so it is computed again
    (again,) = run(engine, prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))
    assert again.num_cached_tokens == 0 and again.prompt_logprobs == first.prompt_logprobs
    assert again.token_ids == first.token_ids
    (scored,) = run(engine, prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))  # the prompt alone
    assert scored.token_ids == [] and scored.finish_reason == "length" and scored.text == ""
    assert [e.logprob for e in scored.prompt_logprobs[1:]] == [e.logprob for e in first.prompt_logprobs[1:]]
    (without,) = run(engine, prompt, SamplingParams(max_tokens=2, temperature=0.0))
    assert without.prompt_logprobs is None and without.num_cached_tokens > 0 and without.token_ids == first.token_ids


def test_token_logprobs_ranks_ties_by_id_and_normalises():
    logits = np.array([[1.0, 3.0, 3.0, 0.5], [0.0, 0.0, 0.0, 0.0]], np.float32)
    high, flat = token_logprobs(logits, [3, 2], top=2)
    assert [t for t, _ in high.top] == [1, 2] and high.token_id == 3
    assert np.exp([v for _, v in high.top]).sum() + np.exp(high.logprob) < 1
    assert flat.logprob == pytest.approx(np.log(0.25)) and [t for t, _ in flat.top] == [0, 1]
    assert token_logprobs(logits, [0], top=0)[0].top == []


def test_prompt_logprobs_are_validated(engine_factory):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
