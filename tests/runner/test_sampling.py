"""Sampling parameters: validation where they enter (the sampler graph itself: tests/builder/test_sampler.py)."""

from __future__ import annotations

import pytest

from runner.sampling import SamplingParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": -1}, "max_tokens"),
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
