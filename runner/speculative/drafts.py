"""The host side of speculative decoding: draft beams -> a token tree to verify, and prompt-lookup drafts.

Draft beams share prefixes (every beam starts after the same root, and beam search keeps siblings), so they are
packed into a trie: one node per distinct prefix, node 0 the root (the last emitted token, not yet in the cache).
The target scores every node in one verify call with an ancestors-only mask, and the engine's sampler graph
(builder/sampler_graph.py) accepts.

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
    most `max_depth` draft levels, its nodes in the order the beams first reach them (`ranked_drafts`' paths: in
    their rank order)."""
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


def ranked_drafts(
    chain: list[int], beams: np.ndarray, prefix_logprobs: np.ndarray | None, min_prob: float, max_nodes: int | None
) -> list[list[int]]:
    """The token paths of a verify tree's nodes below the root, best first (each after its parent), until the tree
    (root included) has `max_nodes` (None: no limit): a chain's tokens first (the prompt-lookup draft, or a draft
    model's greedy continuation), then the draft head's prefixes (beams [W, K]) from the most to the least likely by
    the log-probability the head gives them ([W, K]; None: unranked, shallow prefixes first), those under `min_prob`
    left out. Packed in this order (`pack_tree`), node i of the tree is the i-th choice, so the tree a smaller limit
    m gives is its first m nodes: what a verify step accepted tells what trees of every smaller limit would have
    accepted (`SpeculationPolicy.record_verify`).

    Why that order: a lookup draft copies what followed an earlier occurrence of the context's last two tokens, and
    the target accepts its tokens more often than the head's probabilities promise past their first token
    (docs/measurements.md). Why a node limit: a verify call costs a decode step plus a fraction of one per node up to
    the matmul kernel's rows per pass (`runner.core.machine`), then a second pass; the nodes past it were the least
    likely ones, worth less than that pass."""
    ranked = [tuple(chain[:depth]) for depth in range(1, len(chain) + 1)]
    if prefix_logprobs is None:  # every prefix: shallow first, beam order within a depth
        order = sorted(np.ndindex(*beams.shape), key=lambda node: (node[1], node[0]))
    else:  # likeliest first; a prefix is never likelier than its parent, which the depth tie-break puts first
        likely = prefix_logprobs >= (np.log(min_prob) if min_prob > 0 else -np.inf)
        order = sorted(zip(*np.nonzero(likely)), key=lambda node: (-prefix_logprobs[node], node[1], node[0]))
    ranked += [tuple(int(t) for t in beams[beam, : depth + 1]) for beam, depth in order]  # node: (beam, depth)
    chosen: dict[tuple[int, ...], None] = {}  # insertion-ordered set of token paths below the root
    for path in ranked:
        if max_nodes is not None and len(chosen) + 1 >= max_nodes:
            break
        if path not in chosen and (len(path) == 1 or path[:-1] in chosen):
            chosen[path] = None
    return [list(path) for path in chosen]


class PromptLookup:
    """Prompt-lookup drafts over a growing token sequence (a request's prompt and output so far): the tokens that
    followed the latest earlier occurrence of the sequence's last n tokens, for the longest n from `max_ngram` down to
    `min_ngram` that occurs. An index of every n-gram's latest occurrence is brought up to date with the tokens
    appended since the last call, so no step scans the context: 0.01 ms a row and step at 100 tokens, 0.025 at 8,000
    (the engine's copy of the context included), where a scan took 0.08, 0.42 at 2,000 and 1.1 at 8,000."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.sizes = range(max_ngram, min_ngram - 1, -1)  # longest first
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest occurrence followed by a token
        self.indexed = 1  # the n-grams followed by tokens[1:indexed] are in `latest`

    def draft(self, tokens: list[int], draft_len: int) -> list[int]:
        """At most `draft_len` tokens; [] when nothing matches. `tokens` extends those of the previous call."""
        for follower in range(self.indexed, len(tokens)):
            for n in self.sizes:
                if n <= follower:
                    self.latest[tuple(tokens[follower - n : follower])] = follower - n
        self.indexed = max(self.indexed, len(tokens))
        for n in self.sizes:
            start = self.latest.get(tuple(tokens[-n:])) if n < len(tokens) else None
            if start is not None:
                return tokens[start + n : start + n + draft_len]
        return []


@dataclass
class SpeculationStats:
    """Counters for reporting: verify steps (one per row and step), tokens they emitted, and time shares."""

    verify_steps: int = 0
    emitted_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    accepted_histogram: dict[int, int] = field(default_factory=dict)  # drafts accepted per step -> count
    plain_rows: int = 0  # rows decoded without drafts: the speculation policy ran their step plain

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's own token)."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0

    def record(self, emitted: int) -> None:
        self.verify_steps += 1
        self.emitted_tokens += emitted
        self.accepted_histogram[emitted - 1] = self.accepted_histogram.get(emitted - 1, 0) + 1
