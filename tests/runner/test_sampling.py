"""Sampling parameters and the sampler: validation, filters, and distributions checked statistically."""

from __future__ import annotations

import numpy as np
import pytest

from runner.sampling import SamplingParams, processed_probs, sample_token


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_k": -3}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"seed": "abc"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ],
)
def test_invalid_parameters_are_refused_with_their_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_may_be_a_single_string():
    assert SamplingParams(stop="###").stop == ["###"]


LOGITS = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05]))


def test_top_k_top_p_min_p_filters():
    assert np.count_nonzero(processed_probs(LOGITS, SamplingParams(top_k=2))) == 2
    # top-p keeps the smallest prefix reaching p: 0.4 + 0.3 >= 0.6
    np.testing.assert_allclose(processed_probs(LOGITS, SamplingParams(top_p=0.6)), [4 / 7, 3 / 7, 0, 0, 0])
    # min-p drops tokens below min_p * max probability (0.3 * 0.4 = 0.12)
    assert np.count_nonzero(processed_probs(LOGITS, SamplingParams(min_p=0.3))) == 3
    # temperature sharpens
    assert processed_probs(LOGITS, SamplingParams(temperature=0.5))[0] > 0.4


def test_greedy_is_argmax():
    assert sample_token(LOGITS, SamplingParams(temperature=0.0), np.random.default_rng(0)) == 0


def test_samples_follow_the_processed_distribution():
    """Chi-square goodness of fit over 20000 seeded draws (fixed seed: the verdict never changes)."""
    params = SamplingParams(temperature=0.8, top_k=4)
    expected = processed_probs(LOGITS, params)
    rng = np.random.default_rng(1234)
    draws = 20000
    counts = np.bincount([sample_token(LOGITS, params, rng) for _ in range(draws)], minlength=5)
    assert counts[4] == 0  # filtered by top-k
    keep = expected > 0
    chi2 = float((((counts[keep] - draws * expected[keep]) ** 2) / (draws * expected[keep])).sum())
    assert chi2 < 16.27  # p = 0.001 for 3 degrees of freedom


def test_same_seed_same_tokens():
    params = SamplingParams(temperature=1.0, seed=7)
    first = [sample_token(LOGITS, params, np.random.default_rng(7)) for _ in range(1)]
    again = [sample_token(LOGITS, params, np.random.default_rng(7)) for _ in range(1)]
    assert first == again


def test_penalties_follow_vllm_semantics():
    from runner.sampling import apply_penalties

    logits = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    same = apply_penalties(logits, SamplingParams(), [0], [1])
    assert same is logits  # no penalty: no copy, no change
    repeated = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0], [1])
    np.testing.assert_allclose(repeated, [1.0, -2.0, 0.5, 3.0])  # positive / 2, negative * 2, unseen untouched
    penalised = apply_penalties(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [2], [3, 3, 1])
    np.testing.assert_allclose(penalised, [2.0, -1.0 - 0.75, 0.5, 3.0 - 1.0])  # output only; prompt token 2 untouched
    np.testing.assert_allclose(logits, [2.0, -1.0, 0.5, 3.0])  # the caller's logits are not modified


def test_top_logprobs_are_normalised_and_sorted():
    from runner.sampling import top_logprobs

    logprobs, top = top_logprobs(LOGITS, 3)
    np.testing.assert_allclose(np.exp(logprobs).sum(), 1.0)
    assert list(top) == [0, 1, 2]
    np.testing.assert_allclose(logprobs[0], np.log(0.4))
