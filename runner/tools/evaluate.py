"""Perplexity over a text with a sliding window, on the engine's `score` phase (logits at every position).

Windows of `window` tokens start every `stride` tokens; each window scores only the tokens no earlier window
scored, with the rest of the window as context (the usual strided evaluation, as in Hugging Face's guide). With
stride == window, the first token of each window is not scored (it has no context)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from runner.core.engine import LLMEngine
from runner.sampling.logprobs import log_softmax


@dataclass(frozen=True)
class Perplexity:
    tokens_scored: int
    mean_nll: float
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def perplexity(engine: LLMEngine, token_ids: list[int], window: int, stride: int) -> Perplexity:
    executor = engine.executor
    if not 1 < window <= engine.max_seq_len:
        raise ValueError(f"need 1 < window <= {engine.max_seq_len}")
    if engine.scheduler.has_work:
        raise RuntimeError("evaluate on an idle engine: it uses cache row 0")
    try:
        return strided_perplexity(
            token_ids,
            window,
            stride,
            lambda ids: np.concatenate([scored.logits for scored in executor.score_chunks(ids)]),
        )
    finally:
        executor.cache.release()


def strided_perplexity(
    token_ids: list[int], window: int, stride: int, window_logits: Callable[[list[int]], np.ndarray]
) -> Perplexity:
    """The strided evaluation of any model: `window_logits(ids)` gives the logits [len(ids), vocab] of a sequence
    read from position 0 (benchmarks/compare_peers.py scores the peers with it)."""
    if not 1 < window or not 0 < stride <= window:
        raise ValueError("need 1 < window and 0 < stride <= window")
    if len(token_ids) < 2:
        raise ValueError("the text has fewer than 2 tokens")
    start_time = time.perf_counter()
    total, count, scored_until = 0.0, 0, 1  # token 0 is never predicted
    begin = 0
    while scored_until < len(token_ids):
        end = min(begin + window, len(token_ids))
        logits = window_logits(token_ids[begin:end])
        # logits row j (position begin + j) predicts token begin + j + 1; a window's first token has no context in
        # it, so it is scored only if an earlier window did (when stride == window it is skipped, as in HF's recipe)
        target_from = max(scored_until, begin + 1)
        first = target_from - begin - 1
        targets = np.asarray(token_ids[target_from:end])
        rows = np.asarray(logits[first : first + len(targets)], np.float32)
        total -= float(log_softmax(rows)[np.arange(len(targets)), targets].sum())
        count += len(targets)
        scored_until = end
        begin += stride
    return Perplexity(count, total / count, time.perf_counter() - start_time)
