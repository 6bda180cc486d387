"""Hugging Face transformers as the independent reference: logits and greedy tokens without any cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def load_reference(checkpoint: Path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def reference_logits(model, token_ids: list[int]) -> np.ndarray:
    """Logits at every position of `token_ids`, [len, vocab]."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().numpy()


def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation recomputing the whole sequence each step (no cache to share bugs with)."""
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(np.argmax(reference_logits(model, tokens)[-1])))
    return tokens[len(prompt) :]
