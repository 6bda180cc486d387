"""The target in PyTorch (training/torch_target.py): the answers and hidden states `train-drafter --device` learns
from are those the engine of the same checkpoint gives."""

from __future__ import annotations

import numpy as np

from training.drafter import TargetAnswers
from training.torch_target import TorchTargetAnswers

PROMPTS = ["Explain tides.", "Write a long poem about the sea and its many moods, please.", "Hi", "Name a colour."]


def test_batched_answers_and_states_equal_the_engines(engine_factory, checkpoint_factory):
    engine_traces, engine_tokens = TargetAnswers(engine_factory("gqa"), None, None).traces(PROMPTS, 12)
    # batches of 3 over 4 prompts of different lengths: padding, reordering and a short last batch
    torch_traces, torch_tokens = TorchTargetAnswers(str(checkpoint_factory("gqa")), "cpu", 3).traces(PROMPTS, 12)
    assert torch_tokens == engine_tokens
    for ours, theirs in zip(torch_traces, engine_traces, strict=True):
        np.testing.assert_array_equal(ours.tokens, theirs.tokens)
        np.testing.assert_allclose(ours.hidden, theirs.hidden, rtol=1e-4, atol=1e-4)


def test_an_answer_ends_with_its_end_of_sequence_token(checkpoint_factory):
    target = TorchTargetAnswers(str(checkpoint_factory("gqa")), "cpu")
    eos = target.config.eos_token_ids[0]
    answers = target.greedy(target.prompt_ids(PROMPTS), 40)
    for tokens, hidden in answers:
        assert len(hidden) == len(tokens) <= 41
        assert eos not in tokens[1:-1] and (tokens[-1] == eos or len(tokens) == 41)


def test_train_drafter_on_a_device_trains_from_the_checkpoint(checkpoint_factory, tmp_path):
    import pytest

    from builder.speculation.draft_head import load_draft_head
    from training.drafter import DrafterTrainingOptions, train_drafter

    def options(**changes) -> DrafterTrainingOptions:
        settings = dict(prompts=8, validation=2, max_new_tokens=6, draft_vocab=32, epochs=1, batch_size=16)
        settings |= dict(device="cpu", generate_batch=4, traces=tmp_path / "traces") | changes
        return DrafterTrainingOptions(checkpoint_factory("gqa"), tmp_path / "head.safetensors", **settings)

    facts = train_drafter(options(), log=lambda line: None)
    head, record = load_draft_head(tmp_path / "head.safetensors")
    assert head.config.draft_vocab_size == 32 and "PyTorch float32 on cpu" in record["scored_by"]
    assert facts["answer_tokens"] > 0
    with pytest.raises(ValueError, match="answer length"):  # the traces' key names the generator and answer length
        train_drafter(options(max_new_tokens=7), log=lambda line: None)
    with pytest.raises(ValueError, match="--score-engine"):
        options(score_engine=tmp_path)
