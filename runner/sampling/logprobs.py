"""Log-probabilities of given tokens under the model's raw logits, and the most likely alternatives: what the
prompt's tokens get (`prompt_logprobs`, the completions API's `echo` with `logprobs`) and what perplexity sums.
Computed on the host in float64 from the step graph's logits; the sampler graph computes generated tokens' logprobs
the same way (raw logits, before any sampling parameter), so both kinds agree."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) of the most likely tokens, best first
    rank: int | None = None  # 1 + how many tokens are likelier (prompt logprobs; None where not computed)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[..., vocab] float logits -> float64 log-probabilities."""
    shifted = logits.astype(np.float64)
    shifted -= logits.max(axis=-1, keepdims=True)  # in place: `runner eval` passes windows of 512 x 49k logits
    shifted -= np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return shifted


def token_logprobs(logits: np.ndarray, targets: list[int], top: int) -> list[TokenLogprob]:
    """For each row of `logits` [n, vocab], the log-probability of `targets[i]`, its rank and the `top` most likely
    tokens (best first, ties by lower id)."""
    logprobs = log_softmax(logits[: len(targets)])
    result = []
    for row, token in zip(logprobs, targets):
        best = np.argpartition(-row, top - 1)[:top] if top else np.empty(0, np.int64)
        best = best[np.lexsort((best, -row[best]))]
        rank = 1 + int((row > row[token]).sum())
        result.append(TokenLogprob(int(token), float(row[token]), [(int(t), float(row[t])) for t in best], rank))
    return result
