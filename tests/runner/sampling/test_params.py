"""Sampling parameters: validation where they enter (the sampler graph itself: tests/builder/test_sampler_graph.py)."""

from __future__ import annotations

import pytest

from runner.sampling.bad_words import BadWords
from runner.sampling.params import SamplingParams


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
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"bad_words": ["x"], "allowed_token_ids": [1]}, "allowed_token_ids and bad_words cannot be combined"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"detokenize": 0}, "detokenize"),
        ({"detokenize": False, "stop": ["."]}, "stop strings need detokenize=True"),
    ],
)
def test_invalid_parameters_are_refused_with_their_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_may_be_a_single_string():
    assert SamplingParams(stop="###").stop == ["###"]


def test_bad_words_ban_the_last_token_of_each_form_after_the_rest():
    # a fake vocabulary: the word alone is tokens 5 6, after a space 7 6; "x" is one token both ways
    encode = {"ab": [5, 6], " ab": [7, 6], "x": [9], " x": [9]}.__getitem__
    words = BadWords([" ab", "x"], encode)  # leading spaces do not matter: both forms are banned
    assert words.sequences == [(5, 6), (7, 6), (9,)]
    assert words.banned([]) == [9]
    assert sorted(words.banned([1, 5])) == [6, 9] and sorted(words.banned([7])) == [6, 9]
    assert words.banned([5, 1]) == [9]
