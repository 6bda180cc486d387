"""The ReDrafter head: beam search against an independent reference, the exported draft graph against torch,
the vocabulary maps, and the head file format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from builder.speculation.draft_head import (
    BeamSearchDrafter,
    DraftHead,
    DraftHeadConfig,
    load_draft_head,
    save_draft_head,
)


def make_head(seed: int = 0, draft_vocab: int = 16, target_vocab: int = 40) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig(hidden_size=8, target_vocab_size=target_vocab, draft_vocab_size=draft_vocab))
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.8)  # peaked distributions, so beams really differ
    head.set_vocabulary(torch.randperm(target_vocab)[:draft_vocab])
    return head.eval()


def reference_beam_search(head: DraftHead, hidden: torch.Tensor, last_token: int, width: int, length: int):
    """Plain-Python beam search over (draft tokens, state, score), only beam 0 live on the first step."""
    draft_row = int(head.target_to_draft[last_token])
    with torch.no_grad():
        state, logprobs = head.step(hidden[None], torch.zeros(1, hidden.shape[0]), torch.tensor([draft_row]))
    beams = [([], state, [0.0])]  # (draft tokens, state, log-probability of each prefix)
    step_logprobs = [logprobs[0]]
    for step in range(length):
        candidates = []
        for (tokens, state, scores), logprobs in zip(beams, step_logprobs):
            for token in range(logprobs.shape[0]):
                candidates.append((scores + [scores[-1] + float(logprobs[token])], tokens + [token], state))
        candidates.sort(key=lambda c: -c[0][-1])
        beams = [(tokens, state, scores) for scores, tokens, state in candidates[:width]]
        if step + 1 < length:
            step_logprobs = []
            new_beams = []
            for tokens, state, score in beams:
                with torch.no_grad():
                    new_state, logprobs = head.step(hidden[None], state, torch.tensor([tokens[-1]]))
                new_beams.append((tokens, new_state, score))
                step_logprobs.append(logprobs[0])
            beams = new_beams
    return [[int(head.draft_to_target[t]) for t in tokens] for tokens, _, _ in beams], [
        scores[1:] for _, _, scores in beams
    ]


@pytest.mark.parametrize("width,length", [(1, 4), (3, 3), (4, 2)])
def test_beam_search_equals_a_reference_beam_search(width, length):
    head = make_head()
    drafter = BeamSearchDrafter(head, width, length)
    hidden = torch.randn(3, 8)
    last = torch.tensor([0, 5, 39])
    with torch.no_grad():
        beams, scores = drafter(hidden, last)
    for b in range(3):
        expected, expected_scores = reference_beam_search(head, hidden[b], int(last[b]), width, length)
        assert beams[b].tolist() == expected
        np.testing.assert_allclose(scores[b].numpy(), expected_scores, rtol=1e-5, atol=1e-5)


def test_exported_draft_graph_matches_torch(tmp_path):
    import onnxruntime as ort

    from builder.export import export_draft_graph

    head = make_head(seed=1)
    drafter = BeamSearchDrafter(head, 3, 4)
    spec = export_draft_graph(drafter, tmp_path)
    session = ort.InferenceSession(str(tmp_path / spec.file), providers=["CPUExecutionProvider"])
    hidden = torch.randn(5, 8)
    last = torch.tensor([1, 2, 3, 39, 0])
    tokens, scores = session.run(None, {"hidden": hidden.numpy(), "last_token": last.numpy()})
    with torch.no_grad():
        expected_tokens, expected_scores = drafter(hidden, last)
    assert tokens.shape == (5, 3, 4)
    np.testing.assert_array_equal(tokens, expected_tokens.numpy())
    np.testing.assert_allclose(scores, expected_scores.numpy(), rtol=1e-4, atol=1e-4)


def test_vocabulary_maps_and_other_tokens():
    head = make_head()
    ids = head.draft_to_target
    assert torch.equal(head.target_to_draft[ids], torch.arange(16))
    others = [t for t in range(40) if t not in set(ids.tolist())]
    assert (head.target_to_draft[others] == 16).all()  # the shared "any other token" input row
    with pytest.raises(ValueError, match="distinct"):
        head.set_vocabulary(torch.zeros(16, dtype=torch.long))


def test_head_file_round_trip_and_errors(tmp_path):
    head = make_head()
    path = tmp_path / "head.safetensors"
    save_draft_head(head, path, {"note": {"x": 1}})
    loaded, facts = load_draft_head(path)
    assert facts == {"note": {"x": 1}}
    assert torch.equal(loaded.draft_to_target, head.draft_to_target)
    torch.testing.assert_close(loaded.embed.weight, head.embed.weight.half().float())
    with pytest.raises(ValueError, match="not found"):
        load_draft_head(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        load_draft_head(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a draft head"):
        load_draft_head(tmp_path / "other.safetensors")
