"""Drafter distillation (training/drafter.py): the draft vocabulary, teacher-forced examples, the target's tables
for the soft targets, and the traces cache."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from builder.speculation.draft_head import DraftHead, DraftHeadConfig
from training.drafter import IGNORE, Trace, draft_labels, draft_vocabulary, training_examples


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


def test_draft_labels_map_target_tokens_into_the_draft_vocabulary_and_ignore_the_rest():
    head = DraftHead(DraftHeadConfig(hidden_size=8, target_vocab_size=10, draft_vocab_size=3, num_blocks=1))
    head.set_vocabulary(torch.tensor([7, 2, 5]))
    labels = torch.tensor([[2, 7, IGNORE], [5, 3, 9]])
    assert draft_labels(head, labels).tolist() == [[1, 0, IGNORE], [2, IGNORE, IGNORE]]


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


def test_traces_are_kept_per_shard_resumed_and_refused_for_other_prompts(engine_factory, tmp_path):
    from training.drafter import DrafterTrainingOptions, train_drafter

    traces = tmp_path / "traces"

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
            traces=traces,
            shard_size=4,
            bf16=bf16,
            distill=distill,
        )
        facts = train_drafter(options, log=lines.append)
        assert facts["bf16"] is bf16 and facts["draft_vocab"] == 32 and facts["distill"] == distill
        assert all(math.isfinite(loss) for loss in facts["epoch_losses"])
        return lines

    def progress(lines: list[str]) -> list[str]:
        return [line.strip() for line in lines if "answers, " in line and "ETA" in line]

    first = train(6, bf16=False)
    assert "answers 6 + 2 validation prompts" in first[0]
    assert [line.split("]")[1].split(" answers")[0].split()[-1] for line in progress(first)] == ["2/8", "6/8", "8/8"]
    # a short shard (2 validation prompts of 4) sets no pace: the ETA waits for a whole shard
    assert [line.split("ETA ")[1] for line in progress(first)][:2] == ["--", "0 min"]
    assert sorted(f.name for f in traces.iterdir()) == [
        "traces.json",
        "train-00000.npz",
        "train-00001.npz",
        "validation-00000.npz",
    ]
    assert progress(train(6, bf16=True, distill=0.5)) == []  # every shard read back, no engine loaded
    (traces / "train-00001.npz").unlink()  # a run stopped before its second shard
    assert len(progress(train(6, bf16=False))) == 1
    with pytest.raises(ValueError, match="answers to other prompts"):
        train(7, bf16=False)  # the second shard now holds 3 prompts
    with pytest.raises(ValueError, match="between 0 and 1"):
        train(6, bf16=False, distill=1.5)


def test_a_run_cut_short_leaves_its_best_head_so_far(engine_factory, tmp_path):
    from builder.speculation.draft_head import load_draft_head
    from training.drafter import DrafterTrainingOptions, train_drafter

    class Deadline(Exception):
        pass

    def log(line: str) -> None:
        if "epoch 2/3" in line:  # the machine is taken back while the second epoch is measured
            raise Deadline

    out = tmp_path / "head.safetensors"
    options = DrafterTrainingOptions(
        engine_factory("gqa"), out, prompts=2, validation=1, max_new_tokens=4, draft_vocab=32, epochs=3
    )
    with pytest.raises(Deadline):
        train_drafter(options, log=log)
    head, facts = load_draft_head(out)
    assert facts["kept_epoch"] == 1 and len(facts["epoch_losses"]) == 1 and facts["epochs"] == 3
    assert "validation_tokens_per_step" not in facts  # the whole record comes with the finished head
    assert [path.name for path in tmp_path.iterdir()] == ["head.safetensors"]
    finished = train_drafter(options, log=lambda line: None)
    assert len(load_draft_head(out)[1]["epoch_losses"]) == 3 and "validation_tokens_per_step" in finished


def test_a_scoring_engine_of_the_same_model_gives_the_states_and_keys_the_traces(engine_factory, tmp_path):
    from training.drafter import DrafterTrainingOptions, train_drafter

    def train(score_engine: Path | None, traces: Path | None) -> dict:
        options = DrafterTrainingOptions(
            engine_factory("gqa", quant="int8"),
            tmp_path / "head.safetensors",
            prompts=2,
            validation=1,
            max_new_tokens=4,
            draft_vocab=32,
            epochs=1,
            traces=traces,
            score_engine=score_engine,
        )
        return train_drafter(options, log=lambda line: None)

    fp32 = engine_factory("gqa")
    assert train(fp32, tmp_path / "traces")["answer_tokens"] > 0
    with pytest.raises(ValueError, match="another engine"):  # the same answers, states of another scorer
        train(None, tmp_path / "traces")
    with pytest.raises(ValueError, match="another model"):
        train(engine_factory("mha"), None)


def test_acceptance_by_depth_is_conditional_on_the_drafts_before():
    from training.drafter import acceptance_by_depth

    accepted = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3])  # drafts accepted per step, of 3
    # 7 of 8 steps accept the first draft, 5 of those 7 the second, 2 of those 5 the third
    assert acceptance_by_depth(accepted, 3) == [0.875, round(5 / 7, 3), 0.4]
    assert acceptance_by_depth(torch.zeros(4, dtype=torch.long), 2) == [0.0, 0.0]
