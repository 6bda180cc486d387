"""The sampler written plainly in numpy (float64), one node at a time: the independent reference for the engine's
sampler graph (builder/sampler_graph.py). It reads the same uniforms (per node: u_test when the node is tried as a
draft, u_draw to draw a token at the node), so graph and reference can be compared token for token."""

from __future__ import annotations

import numpy as np

from runner.sampling.params import SamplingParams


def apply_penalties(
    logits: np.ndarray, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> np.ndarray:
    """vLLM's penalties: repetition over prompt + output (divide positive logits, multiply negative ones), then
    presence and frequency over the output only."""
    logits = logits.astype(np.float64, copy=True)
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(prompt_ids + output_ids, dtype=np.int64))
        values = logits[seen]
        logits[seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        tokens, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        logits[tokens] -= params.frequency_penalty * counts + params.presence_penalty
    return logits


def processed_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a token is drawn from: temperature, then top-k, top-p and min-p filtering."""
    if params.greedy:
        probs = np.zeros(logits.shape[-1])
        probs[int(np.argmax(logits))] = 1.0
        return probs
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = cumulative - probs[order] < params.top_p  # the smallest prefix reaching top_p, crossing token included
        filtered = np.zeros_like(probs)
        filtered[order[keep]] = probs[order[keep]]
        probs = filtered / filtered.sum()
    if params.min_p > 0.0:
        probs = np.where(probs < params.min_p * probs.max(), 0.0, probs)
        probs /= probs.sum()
    return probs


def draw(probs: np.ndarray, uniform: float) -> int:
    """Inverse CDF: the first token whose cumulative mass exceeds uniform * total (`probs` need not sum to 1)."""
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf, uniform * cdf[-1], side="right")), len(probs) - 1)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def node_distribution(logits, params: SamplingParams, prompt_ids, output_ids, stop_ids) -> np.ndarray:
    biased = logits.astype(np.float32, copy=True)  # logit_bias first, in the logits' own float32, as vLLM does
    for token, bias in params.logit_bias.items():
        biased[token] += np.float32(bias)
    adjusted = apply_penalties(biased, params, prompt_ids, output_ids)
    if len(output_ids) < params.min_tokens and stop_ids:
        adjusted[list(stop_ids)] = -np.inf
    return processed_probs(adjusted, params)


def walk_tree(
    logits: np.ndarray,
    tokens: list[int],
    parents: list[int],
    uniforms: np.ndarray,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    stop_ids: set[int],
) -> tuple[list[int], list[int]]:
    """Accept drafts down the tree one node at a time; returns the emitted tokens and the path of nodes (root first).

    At a node the children are tried in order: child c is accepted with probability r(c) / sum(r) (u_test of c),
    else r(c) = 0; with none accepted the token is drawn from r (u_draw of the node)."""
    node, path, emitted, history = 0, [0], [], list(output_ids)
    while True:
        residual = node_distribution(logits[node], params, prompt_ids, history, stop_ids)
        accepted = None
        for child in [c for c, p in enumerate(parents) if p == node]:
            if uniforms[child, 0] * residual.sum() < residual[tokens[child]]:
                accepted = child
                break
            residual[tokens[child]] = 0.0
        if accepted is None:
            emitted.append(draw(residual, uniforms[node, 1]))
            return emitted, path
        emitted.append(tokens[accepted])
        history.append(tokens[accepted])
        path.append(accepted)
        node = accepted
