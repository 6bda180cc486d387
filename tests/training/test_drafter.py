"""Drafter distillation (training/drafter.py): the draft vocabulary, teacher-forced examples, the target's tables
for the soft targets, and the traces cache."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from training.drafter import IGNORE, Trace, draft_vocabulary, training_examples


def test_draft_vocabulary_ranks_answer_tokens_by_frequency():
    traces = [Trace(np.array([9, 3, 3, 5, 3, 5, 7]), np.zeros((7, 2), np.float32))]  # tokens[0] is the prompt's
    assert draft_vocabulary(traces, 3, 10).tolist() == [3, 5, 7]
    assert draft_vocabulary(traces, 5, 10).tolist() == [3, 5, 7, 0, 1]  # topped up with the lowest unused ids


def test_training_examples_pair_each_label_with_the_state_that_predicts_it():
    # hidden[i] holds the token it predicts (tokens[i + 1]), -1 after the last token
    def trace(tokens):
        predicted = np.append(np.asarray(tokens[1:], np.float32), -1.0)
        return Trace(np.asarray(tokens), predicted[:, None])

    examples = training_examples([trace([7, 1, 2, 3, 4]), trace([8, 5, 6])], horizon=3)
    assert len(examples) == 4 + 2
    predicts = examples.hidden[:, 0]
    assert torch.equal(predicts[examples.rows], examples.inputs[:, 0].float())  # h_t predicts x_{t+1}
    valid = examples.labels != IGNORE
    assert torch.equal(predicts[examples.future][valid], examples.labels[valid].float())  # and h_{t+j} x_{t+j+1}
    assert examples.labels[0].tolist() == [2, 3, 4] and examples.labels[3].tolist() == [IGNORE] * 3
    assert examples.labels[4].tolist() == [6, IGNORE, IGNORE]


def test_soft_targets_come_from_the_lm_head_and_the_embedding_where_untied(checkpoint_factory):
    from safetensors.torch import load_file

    from training.drafter import target_tables

    weights = {}
    for path in checkpoint_factory("mqa").glob("*.safetensors"):
        weights.update(load_file(str(path)))
    embedding, lm_head = target_tables(str(checkpoint_factory("mqa")), tied=False)
    torch.testing.assert_close(embedding, weights["model.embed_tokens.weight"].float())
    torch.testing.assert_close(lm_head, weights["lm_head.weight"].float())
    assert not torch.equal(embedding, lm_head)
    embedding, lm_head = target_tables(str(checkpoint_factory("gqa")), tied=True)
    assert lm_head is embedding


def test_traces_cache_is_reused_for_the_same_prompts_and_refused_for_others(engine_factory, tmp_path):
    from training.drafter import DrafterTrainingOptions, train_drafter

    def train(prompts: int, bf16: bool, distill: float = 0.0) -> list[str]:
        lines = []
        options = DrafterTrainingOptions(
            engine_factory("gqa"),
            tmp_path / "head.safetensors",
            prompts=prompts,
            validation=2,
            max_new_tokens=6,
            draft_vocab=32,
            epochs=1,
            batch_size=16,
            traces=tmp_path / "traces.npz",
            bf16=bf16,
            distill=distill,
        )
        facts = train_drafter(options, log=lines.append)
        assert facts["bf16"] is bf16 and facts["draft_vocab"] == 32 and facts["distill"] == distill
        assert all(math.isfinite(loss) for loss in facts["epoch_losses"])
        return lines

    assert "answers 6 + 2 validation prompts" in train(6, bf16=False)[0]
    assert "reading the target's answers" in train(6, bf16=True, distill=0.5)[0]
    with pytest.raises(ValueError, match="another engine or prompt set"):
        train(7, bf16=False)
    with pytest.raises(ValueError, match="between 0 and 1"):
        train(6, bf16=False, distill=1.5)
