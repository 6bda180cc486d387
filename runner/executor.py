"""Runs one scheduled piece of work on the engine's phase graphs: maps it to a bucket, pads, feeds the cache views,
and writes the new K/V back. Knows shapes and buffers, nothing of requests or sampling."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.format import Artifact, PhaseSpec
from runner.kv_cache import KVCache, bucket_for


class Executor:
    def __init__(self, artifact: Artifact, backend) -> None:
        manifest = artifact.manifest
        self.backend = backend
        self.prefill_phase = manifest.phases["prefill"]
        self.decode_phase = manifest.phases["decode"]
        self.verify_phase = manifest.phases["verify"]
        self.score_phase = manifest.phases.get("score")  # absent in engines built before `runner eval` existed
        self.speculation = manifest.speculation  # None, or how the engine drafts (see builder/build.py)
        self.max_rows = max(self.decode_phase.batch_sizes)
        self.max_chunk = max(self.prefill_phase.steps)
        self.cache = KVCache(manifest.kv_cache, self.decode_phase.batch_sizes, self.decode_phase.past_lengths)

    def reserve(self, rows: int, length: int) -> None:
        """Make room for `rows` rows (row ids below it) of up to `length` positions before a step."""
        self.cache.fit(rows, length)

    def _feeds(self, input_ids, positions, past_lens, tree_mask, logits_index, start_row, stop_row, length=None) -> dict:
        keys, values = self.cache.views(start_row, stop_row, length)
        feeds = {
            "input_ids": input_ids,
            "positions": positions,
            "past_lens": past_lens,
            "tree_mask": tree_mask,
            "logits_index": logits_index,
        }
        feeds.update({f"past_key.{i}": k for i, k in enumerate(keys)})
        feeds.update({f"past_value.{i}": v for i, v in enumerate(values)})
        return feeds

    def prefill(self, row: int, token_ids: list[int], start: int) -> tuple[np.ndarray, np.ndarray]:
        """Run one prompt chunk of one row whose first `start` tokens are cached; returns the last token's logits
        [vocab] and final hidden state [hidden] (where a draft head starts from)."""
        logits, hidden = self._chunk(self.prefill_phase, row, token_ids, start)
        return logits[0], hidden[0]

    def score(self, row: int, token_ids: list[int], start: int) -> tuple[np.ndarray, np.ndarray]:
        """Like `prefill`, but returns the logits [n, vocab] and hidden states [n, hidden] after every token."""
        return self._chunk(self.score_phase, row, token_ids, start)

    def _chunk(self, phase: PhaseSpec, row: int, token_ids: list[int], start: int) -> tuple[np.ndarray, np.ndarray]:
        count = len(token_ids)
        causal = np.tril(np.ones((count, count), dtype=bool))
        input_ids, positions, tree_mask = _row_inputs(token_ids, start, causal, bucket_for(count, phase.steps))
        logits_index = np.arange(count)[None] if phase.logits == "all" else np.array([[count - 1]])
        past = bucket_for(max(start, 1), phase.past_lengths)
        feeds = self._feeds(input_ids, positions, np.array([start], np.int64), tree_mask, logits_index, row, row + 1, past)
        out = self.backend.run(phase.graph, feeds)
        self.cache.write(row, start, out["new_keys"][:, 0, :count], out["new_values"][:, 0, :count])
        return out["logits"][0], out["hidden"][0]

    def decode(self, rows: list[int], token_ids: list[int], positions: list[int]) -> np.ndarray:
        """One token for each of `rows` (token at `positions`, i.e. that many cached); returns [len(rows), vocab]."""
        batch = bucket_for(max(rows) + 1, self.decode_phase.batch_sizes)
        input_ids = np.zeros((batch, 1), np.int64)
        step_positions = np.zeros((batch, 1), np.int64)
        input_ids[rows, 0] = token_ids
        step_positions[rows, 0] = positions
        past_lens = step_positions[:, 0].copy()
        tree_mask = np.ones((batch, 1, 1), dtype=bool)
        feeds = self._feeds(input_ids, step_positions, past_lens, tree_mask, np.zeros((batch, 1), np.int64), 0, batch)
        out = self.backend.run(self.decode_phase.graph, feeds)
        for row, position in zip(rows, positions):
            self.cache.write(row, position, out["new_keys"][:, row], out["new_values"][:, row])
        return out["logits"][rows, 0]

    def verify(self, rows: list[int], trees: list[tuple[list[int], np.ndarray]], starts: list[int]) -> Verified:
        """Score a token tree per row, all rows in one call: trees are (node tokens, ancestors mask [n, n]), each
        after its row's `start` cached positions.

        Returns logits [rows, nodes, vocab], hidden states and the nodes' K/V; nothing is written to the cache,
        since only accepted nodes belong there (`commit` stores them)."""
        batch = bucket_for(max(rows) + 1, self.verify_phase.batch_sizes)
        steps = bucket_for(max(len(tokens) for tokens, _ in trees), self.verify_phase.steps)
        input_ids = np.zeros((batch, steps), np.int64)
        positions = np.zeros((batch, steps), np.int64)
        past_lens = np.zeros(batch, np.int64)
        mask = np.broadcast_to(np.eye(steps, dtype=bool), (batch, steps, steps)).copy()
        for row, (tokens, tree_mask), start in zip(rows, trees, starts):
            input_ids[row], positions[row], mask[row] = (a[0] for a in _row_inputs(tokens, start, tree_mask, steps))
            past_lens[row] = start
        index = np.broadcast_to(np.arange(steps, dtype=np.int64), (batch, steps)).copy()
        feeds = self._feeds(input_ids, positions, past_lens, mask, index, 0, batch)
        out = self.backend.run(self.verify_phase.graph, feeds)
        return Verified(out["logits"][rows], out["hidden"][rows], out["new_keys"][:, rows], out["new_values"][:, rows])

    def commit(self, row: int, start: int, verified: Verified, index: int, nodes: list[int]) -> None:
        """Store the K/V of the accepted `nodes` (root first, then the accepted path) of verified row `index`."""
        self.cache.write(row, start, verified.new_keys[:, index, nodes], verified.new_values[:, index, nodes])

    def draft(self, hidden: np.ndarray, last_tokens: list[int]) -> np.ndarray:
        """Draft beams [n, beams, draft_len] (target token ids) from hidden states [n, hidden] and last tokens."""
        count = len(last_tokens)
        batch = bucket_for(count, self.verify_phase.batch_sizes)
        padded_hidden = np.zeros((batch, hidden.shape[-1]), np.float32)
        padded_hidden[:count] = hidden
        tokens = np.zeros(batch, np.int64)
        tokens[:count] = last_tokens
        out = self.backend.run(self.speculation["graph"], {"hidden": padded_hidden, "last_token": tokens})
        return out["draft_tokens"][:count]


@dataclass(frozen=True)
class Verified:
    logits: np.ndarray  # [rows, nodes, vocab]
    hidden: np.ndarray  # [rows, nodes, hidden]
    new_keys: np.ndarray  # [layers, rows, nodes, kv_heads, head_dim]
    new_values: np.ndarray


def _row_inputs(token_ids: list[int], start: int, tree_mask: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row of `steps` new tokens: the real ones padded with token 0. A token's position is `start` plus its
    depth in the tree (its index for a causal chain); padding tokens see only themselves, so no row is fully
    masked."""
    count = len(token_ids)
    input_ids = np.zeros((1, steps), np.int64)
    input_ids[0, :count] = token_ids
    positions = np.full((1, steps), start, np.int64)
    positions[0, :count] = start + tree_mask.sum(axis=1) - 1
    mask = np.eye(steps, dtype=bool)[None]
    mask[0, :count, :count] = tree_mask
    return input_ids, positions, mask
