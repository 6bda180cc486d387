"""Perplexity on the score phase against transformers on the same tokens and windows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from runner.tools.evaluate import perplexity, strided_perplexity
from tests.reference import load_reference, reference_logits
from tests.tiny_checkpoint import CORPUS


def reference_perplexity(model, ids: list[int], window: int, stride: int) -> float:
    total, count, scored_until, begin = 0.0, 0, 1, 0
    while scored_until < len(ids):
        end = min(begin + window, len(ids))
        logits = reference_logits(model, ids[begin:end]).astype(np.float64)
        log_probs = (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True)
        )
        for position in range(max(scored_until, begin + 1), end):
            total -= log_probs[position - begin - 1, ids[position]]
            count += 1
        scored_until = end
        begin += stride
    return math.exp(total / count)


@pytest.mark.parametrize("window, stride", [(64, 64), (64, 24), (300, 100)])
def test_perplexity_matches_transformers(window, stride, engine_factory, checkpoint_factory):
    # prefill chunk 32 < window: each window is scored in several chunks
    engine = LLMEngine(EngineArgs(engine_factory("gqa")))
    ids = engine.codec.encode(CORPUS * 2)[:150]
    ours = perplexity(engine, ids, window=min(window, 255), stride=stride)
    expected = reference_perplexity(load_reference(checkpoint_factory("gqa")), ids, min(window, 255), stride)
    skipped = 0 if stride < window else len(range(window, len(ids), window))  # window starts without context
    assert ours.tokens_scored == len(ids) - 1 - skipped
    assert ours.perplexity == pytest.approx(expected, rel=1e-4)
    assert not engine.scheduler.has_work and engine.executor.cache.resident_bytes() == 0


def test_bad_windows_are_refused(engine_factory):
    engine = LLMEngine(EngineArgs(engine_factory("gqa")))
    with pytest.raises(ValueError, match="window"):
        perplexity(engine, [1, 2, 3], window=10_000, stride=10)
    with pytest.raises(ValueError, match="fewer than 2"):
        perplexity(engine, [1], window=16, stride=8)


@pytest.mark.parametrize("window, stride", [(8, 8), (8, 3), (50, 10)])
def test_strided_perplexity_of_a_model_that_knows_nothing_is_the_vocabulary_size(window, stride):
    """Uniform logits over 7 tokens: every scored token costs log 7, whatever the windows."""
    windows = []

    def window_logits(ids):
        windows.append(ids)
        return np.zeros((len(ids), 7), np.float32)

    ids = list(range(7)) * 4
    result = strided_perplexity(ids, window, stride, window_logits)
    assert result.perplexity == pytest.approx(7.0)
    skipped = 0 if stride < window else len(range(window, len(ids), window))
    assert result.tokens_scored == len(ids) - 1 - skipped
    assert all(len(w) <= window for w in windows) and windows[0] == ids[:window]
