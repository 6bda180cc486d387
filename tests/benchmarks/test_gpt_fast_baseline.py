"""The GPU anchor (benchmarks/gpt_fast_baseline.py) decodes what transformers decodes, eagerly and compiled (on CPU
here; the device check times it with CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpt_fast_baseline import time_decode
from tests.reference import load_reference, reference_greedy


@pytest.mark.parametrize("compile_mode", [None, "default"])
def test_greedy_tokens_equal_transformers(checkpoint_factory, compile_mode):
    checkpoint = checkpoint_factory("gqa")
    prompt = [5, 17, 42, 9, 100, 3]
    run = time_decode(checkpoint, prompt, 2, 10, device="cpu", dtype=torch.float32, compile_mode=compile_mode)
    assert run["tokens"] == reference_greedy(load_reference(checkpoint), prompt, 10)
    assert run["batch"] == 2 and run["decode_tok_s"] > 0
