"""The host side of speculative decoding: draft beams -> a token tree to verify, and prompt-lookup drafts.

Draft beams share prefixes (every beam starts after the same root, and beam search keeps siblings), so they are
packed into a trie: one node per distinct prefix, node 0 the root (the last emitted token, not yet in the cache).
The target scores every node in one verify call with an ancestors-only mask, and the engine's sampler graph
(builder/sampler.py) accepts.

Why that acceptance is exact. At a node, the target's distribution q (after penalties, temperature, top-k, top-p,
min-p: exactly what plain decoding would sample from) picks the next token among the node's children, which are
deterministic drafts (a point mass each): child c is accepted with probability r(c) / sum(r), else r(c) is set to
0 and the next child is tried; when none is accepted the token is drawn from r / sum(r). Every token x comes out
with probability q(x) (for a child c_j: prod of the rejections times r(c_j)/sum(r) telescopes to q(c_j)), which is
modified rejection sampling with p = a point mass per candidate. Greedy is the same walk with q = one-hot(argmax):
accept the child equal to the target's argmax, so greedy output is plain greedy decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_ROOT_ALONE = np.ones((1, 1), bool)
_ROOT_ALONE.flags.writeable = False  # shared by every tree of the root alone


@dataclass(frozen=True)
class TokenTree:
    tokens: list[int]  # node -> token; node 0 is the root
    parents: list[int]  # node -> parent node (-1 for the root)
    mask: np.ndarray  # [n, n] bool: node t attends to node s (its ancestors and itself)


def pack_tree(root_token: int, beams, max_depth: int) -> TokenTree:
    """Merge draft beams (sequences of token ids, best first; any lengths) under `root_token` into a trie of at
    most `max_depth` draft levels."""
    if max_depth == 0 or len(beams) == 0:  # a plain decode step's tree: made every step, so made cheaply
        return TokenTree([int(root_token)], [-1], _ROOT_ALONE)
    tokens, parents = [int(root_token)], [-1]
    node_of: dict[tuple[int, ...], int] = {(): 0}
    for beam in beams:
        prefix: tuple[int, ...] = ()
        for token in [int(t) for t in beam][:max_depth]:
            parent = node_of[prefix]
            prefix = prefix + (token,)
            if prefix not in node_of:
                node_of[prefix] = len(tokens)
                tokens.append(token)
                parents.append(parent)
    size = len(tokens)
    mask = np.eye(size, dtype=bool)
    for node in range(1, size):
        mask[node] |= mask[parents[node]]  # parents come before their children
    return TokenTree(tokens, parents, mask)


def likely_prefixes(beams: np.ndarray, prefix_logprobs: np.ndarray, min_prob: float) -> list[np.ndarray]:
    """Each beam cut to the prefix the draft head gives at least `min_prob` (beams [W, K], the log-probability of
    each beam's first k tokens [W, K]). A verify call costs more with every node (fp32, 2 cores: ~0.1 of a decode
    step per node), so a node the target will likely reject costs more than it is worth."""
    keep = (prefix_logprobs >= np.log(min_prob)).sum(axis=-1)  # prefix log-probabilities only fall along a beam
    return [beam[:length] for beam, length in zip(beams, keep)]


def prompt_lookup_draft(tokens: list[int], draft_len: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last n tokens (the
    longest n from `max_ngram` down to `min_ngram` that occurs), at most `draft_len` of them; [] when nothing matches."""
    context = np.asarray(tokens)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = context[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)  # every n-gram that has a successor
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            follow = int(starts[-1]) + n
            return context[follow:follow + draft_len].tolist()
    return []


@dataclass
class SpeculationStats:
    """Counters for reporting: verify steps (one per row and step), tokens they emitted, and time shares."""

    verify_steps: int = 0
    emitted_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    accepted_histogram: dict[int, int] = field(default_factory=dict)  # drafts accepted per step -> count
    plain_rows: int = 0  # rows decoded without drafts: their step had more generating rows than speculation pays for

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's own token)."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0

    def record(self, emitted: int) -> None:
        self.verify_steps += 1
        self.emitted_tokens += emitted
        self.accepted_histogram[emitted - 1] = self.accepted_histogram.get(emitted - 1, 0) + 1
