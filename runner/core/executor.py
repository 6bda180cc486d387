"""Runs one scheduled piece of work on the engine's phase graphs: maps it to a bucket, pads, and binds the cache
rows the call covers (the graph writes the new tokens' K/V into them in place). Knows shapes and buffers, nothing
of requests or sampling."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from engines.format import Artifact, PhaseSpec
from runner.core.kv_cache import make_kv_cache

MASKED = np.finfo(np.float32).min  # attention bias of a position a token must not see


class Executor:
    def __init__(self, artifact: Artifact, backend) -> None:
        manifest = artifact.manifest
        self.backend = backend
        self.prefill_phase = manifest.phases["prefill"]
        self.decode_phase = manifest.phases["decode"]
        self.verify_phase = manifest.phases["verify"]
        self.score_phase = manifest.phases["score"]
        self.speculation = manifest.speculation  # None, or how the engine drafts (see builder/build.py)
        self.max_rows = max(self.decode_phase.batch_sizes)
        # the fewest rows a decode or verify call runs with: 2 where a one-row call rounds differently from a batched
        # one (see `pad_single_rows_if_they_round_differently`)
        self.min_rows = 1
        self.probe_runs = 0  # step graph runs that probe made before any request's (a profile leaves them out)
        self.step_calls = 0  # step graph runs so far (benchmarks count a window's decode calls by it)
        self.max_chunk = max(self.prefill_phase.steps)
        phases = [p for p in manifest.phases.values() if p.graph == self.decode_phase.graph]
        self.cache = make_kv_cache(
            manifest.kv_cache,
            self.max_rows,
            manifest.max_seq_len,
            _headroom(phases),
            getattr(backend, "cache_device", "cpu"),
        )
        self._bound: dict[tuple[str, int, int], object] = {}  # (graph, rows) -> graph with those cache rows bound
        # the step graph's outputs besides the cache, [rows, logits_index count, *size]: their arrays are bound per run
        step = {t.name: t for t in manifest.graphs[self.decode_phase.graph].outputs}
        config = manifest.model
        self._per_token_outputs = {
            "logits": ((config.vocab_size,), np.dtype(step["logits"].dtype)),
            "argmax": ((), np.dtype(step["argmax"].dtype)),
            "hidden": ((config.hidden_size,), np.dtype(step["hidden"].dtype)),
        }
        self.max_seq_len = manifest.max_seq_len
        self._greedy_loops: dict = {}  # batch bucket -> its loop (GreedyDecodeLoop or the backend's), bound once

    def _run(
        self,
        phase: PhaseSpec,
        input_ids,
        positions,
        past_lens,
        query_lens,
        attention_bias,
        logits_index,
        start_row: int,
    ) -> Scored:
        """One call over cache rows [start_row, start_row + batch): those rows' buffers are bound as the graph's cache
        inputs and outputs, so the new K/V land in them. Rows with query_lens 0 take no part."""
        self.step_calls += 1
        key = (phase.graph, start_row, start_row + len(input_ids))
        if key[2] > self.cache.rows:  # (a view past the buffer would be empty, and a compiled graph unchecked)
            raise ValueError(f"cache rows {start_row}..{key[2] - 1} do not exist: the cache has {self.cache.rows}")
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = self.backend.bind(phase.graph, self._cache_buffers(*key[1:]))
        batch, count = logits_index.shape
        outputs = self._output_arrays(batch, count)
        bound.run(
            {
                "input_ids": input_ids,
                "positions": positions,
                "past_lens": past_lens,
                "query_lens": query_lens,
                "attention_bias": attention_bias,
                "logits_index": logits_index,
            },
            outputs,
        )
        return Scored(**outputs)

    def _output_arrays(self, batch: int, count: int) -> dict[str, np.ndarray]:
        """Fresh arrays for the step graph's outputs besides the cache, for `count` tokens with logits in each row."""
        return {name: np.empty((batch, count, *size), dtype) for name, (size, dtype) in self._per_token_outputs.items()}

    def _window(self, rows: list[int], phase: PhaseSpec) -> tuple[int, int]:
        """The cache rows [start, start + batch) a call over `rows` runs as: from the lowest of them to past the
        highest, at least `min_rows`, rounded up to a batch bucket. A call computes every row of its window, so rows
        left in high cache rows when the rows below them finished must not carry those: one row in cache row 3
        would otherwise run a 4-row call (a verify call: 4 rows of its tree's size)."""
        start = min(rows)
        batch = bucket_for(max(max(rows) - start + 1, self.min_rows), phase.batch_sizes)
        return min(start, self.cache.rows - batch), batch

    def prefill(self, row: int, token_ids: list[int], start: int) -> Scored:
        """Run one prompt chunk of one row whose first `start` tokens are cached; returns the last token's logits
        [vocab], their argmax [] and the final hidden state [hidden] (where a draft head starts from)."""
        return self._chunk(self.prefill_phase, row, token_ids, start)[0, 0]

    def score(self, row: int, token_ids: list[int], start: int) -> Scored:
        """Like `prefill`, but after every token: logits [n, vocab], argmax [n], hidden states [n, hidden]."""
        return self._chunk(self.score_phase, row, token_ids, start)[0]

    def score_chunks(self, token_ids: list[int]) -> Iterator[Scored]:
        """Score a whole sequence from position 0 in cache row 0, one `score` call per chunk: each chunk's Scored in
        turn (callers concatenate only what they need: logits over a 49k vocabulary are large)."""
        chunk = max(self.score_phase.steps)
        for start in range(0, len(token_ids), chunk):
            yield self.score(0, token_ids[start : start + chunk], start)

    def _chunk(self, phase: PhaseSpec, row: int, token_ids: list[int], start: int) -> Scored:
        count = len(token_ids)
        steps = bucket_for(count, phase.steps)
        input_ids = np.zeros((1, steps), np.int64)
        input_ids[0, :count] = token_ids
        positions = np.full((1, steps), start, np.int64)  # padding tokens sit at the start: any position in the table
        positions[0, :count] += np.arange(count)
        logits_index = np.arange(count)[None] if phase.logits == "all" else np.array([[count - 1]])
        bias = np.zeros((1, 1, steps, start + steps), np.float32)  # a chunk is causal, which the graph knows
        return self._run(phase, input_ids, positions, np.array([start]), np.array([count]), bias, logits_index, row)

    def decode(self, rows: list[int], token_ids: list[int], positions: list[int]) -> Scored:
        """One token for each of `rows` (token at `positions`, i.e. that many cached); returns logits
        [len(rows), vocab], argmax [len(rows)], hidden [len(rows), hidden]."""
        start, batch = self._window(rows, self.decode_phase)
        index = [row - start for row in rows]
        input_ids, past_lens, query_lens = (
            np.zeros((batch, 1), np.int64),
            np.zeros(batch, np.int64),
            np.zeros(batch, np.int64),
        )
        input_ids[index, 0] = token_ids
        past_lens[index] = positions
        query_lens[index] = 1
        bias = np.zeros((batch, 1, 1, past_lens.max() + 1), np.float32)
        zeros = np.zeros((batch, 1), np.int64)
        decoded = self._run(self.decode_phase, input_ids, past_lens[:, None], past_lens, query_lens, bias, zeros, start)
        return decoded[_select(index), 0]

    def decode_greedy(
        self, rows: list[int], token_ids: list[int], positions: list[int], steps: int, stop: np.ndarray
    ) -> np.ndarray:
        """Up to `steps` decode calls in a row, each row's argmax fed back as its next token: the tokens [len(rows),
        calls made]. Stops before a call whose argmax is a `stop` token (a bool per vocabulary id) in any row: that
        call's choice is the sampler's (a stop token may be banned, min_tokens), so its tokens are left out, and its
        K/V, written where the next call for the row writes the same again, do no harm."""
        window = self._window(rows, self.decode_phase)
        loop = self._greedy_loops.get(window)
        if loop is None:
            loop = self._greedy_loops[window] = self._greedy_loop(*window)
        tokens = loop.run([row - window[0] for row in rows], token_ids, positions, steps, stop)
        self.step_calls += min(steps, tokens.shape[1] + 1)  # and the call that chose a stop token, if one did
        return tokens

    def _greedy_loop(self, start: int, batch: int):
        """Over cache rows [start, start + batch): the backend's own loop where it has one (state kept on its
        device), else GreedyDecodeLoop."""
        device_loop = getattr(self.backend, "greedy_loop", None)
        if device_loop is None:
            return GreedyDecodeLoop(self, start, batch)
        return device_loop(self.decode_phase.graph, self._cache_buffers(start, start + batch), batch, self.max_seq_len)

    def _cache_buffers(self, start_row: int, stop_row: int) -> dict[str, np.ndarray]:
        """The graph's cache inputs and outputs for rows [start_row, stop_row): each layer's view, bound as both."""
        keys, values = self.cache.views(start_row, stop_row)
        buffers = {}
        for i, (k, v) in enumerate(zip(keys, values)):
            buffers[f"past_key.{i}"] = buffers[f"present_key.{i}"] = k
            buffers[f"past_value.{i}"] = buffers[f"present_value.{i}"] = v
        return buffers

    def verify(self, rows: list[int], trees: list[tuple[list[int], np.ndarray]], starts: list[int]) -> Scored:
        """Score a token tree per row, all rows in one call: trees are (node tokens, ancestors mask [n, n]), each
        after its row's `start` cached positions.

        Returns logits [rows, nodes, vocab], their argmax and hidden states. Every node's K/V is written after its
        row's `start` cached positions, in node order; only accepted nodes belong in the cache (`commit` keeps them)."""
        return self._score_trees(rows, trees, starts, last_only=False)

    def extend(self, rows: list[int], token_lists: list[list[int]], starts: list[int]) -> Scored:
        """Append a few tokens to each of `rows` (after its `start` cached positions), all rows in one call; returns
        logits [rows, vocab], argmax and hidden state of each row's last token only (one LM-head row per row: the
        vocabulary projection is the largest matmul of a small model)."""
        chains = [(tokens, np.tril(np.ones((len(tokens), len(tokens)), bool))) for tokens in token_lists]
        return self._score_trees(rows, chains, starts, last_only=True)[:, 0]

    def _score_trees(
        self, rows: list[int], trees: list[tuple[list[int], np.ndarray]], starts: list[int], last_only: bool
    ) -> Scored:
        first, batch = self._window(rows, self.verify_phase)
        index = [row - first for row in rows]
        steps = bucket_for(max(len(tokens) for tokens, _ in trees), self.verify_phase.steps)
        input_ids, positions = np.zeros((batch, steps), np.int64), np.zeros((batch, steps), np.int64)
        past_lens, query_lens = np.zeros(batch, np.int64), np.zeros(batch, np.int64)
        past_lens[index] = starts
        bias = np.zeros((batch, 1, steps, past_lens.max() + steps), np.float32)
        for row, (tokens, tree_mask), start in zip(index, trees, starts):
            count = query_lens[row] = len(tokens)
            input_ids[row, :count] = tokens
            positions[row, :count] = start + tree_mask.sum(axis=1) - 1  # a node's position is its depth
            bias[row, 0, :count, start : start + count][~tree_mask] = MASKED  # (the graph masks what is causal)
        if last_only:
            logits_index = np.maximum(query_lens - 1, 0)[:, None]
        else:
            logits_index = np.tile(np.arange(steps, dtype=np.int64), (batch, 1))
        scored = self._run(self.verify_phase, input_ids, positions, past_lens, query_lens, bias, logits_index, first)
        return scored[_select(index)]

    def pad_single_rows_if_they_round_differently(self) -> None:
        """Run one-row decode and verify calls padded to two rows if a lone row's logits are not, bit for bit, what
        the same row gets in a batch, so that a request's greedy tokens do not depend on what else runs.

        Not always so: onnxruntime's CPU MatMulNBits takes another kernel for one row than for several at some group
        sizes and with fp32 compute (on a Zen 5: int8 groups of 128, int4 groups of 64 and more, every
        `--no-int8-compute` engine), which rounds differently; with int8 activations such differences grow to whole
        logits within a few layers. Probed with two tokens at position 0 of cache rows 0 and 1 (their pages are
        given back after). Costs the padded row's compute at batch 1 (docs/measurements.md)."""
        self.min_rows = 1
        if self.max_rows < 2:
            return
        self.probe_runs += 2
        alone = self.decode([0], [1], [0]).logits[0].copy()
        batched = self.decode([0, 1], [1, 2], [0, 0]).logits[0]
        self.cache.free_row(0)
        self.cache.free_row(1)
        if not np.array_equal(alone, batched):
            self.min_rows = 2

    def commit(self, row: int, start: int, nodes: list[int]) -> None:
        """Keep the K/V of the accepted `nodes` of a verified tree (root first, then the accepted path)."""
        self.cache.keep(row, start, nodes)

    def draft(self, hidden: np.ndarray, last_tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Draft beams [n, beams, draft_len] (target token ids) from hidden states [n, hidden] and last tokens, and the
        log-probability the head gives each beam's first k tokens [n, beams, draft_len]."""
        count = len(last_tokens)
        batch = bucket_for(count, self.verify_phase.batch_sizes)
        padded_hidden = np.zeros((batch, hidden.shape[-1]), np.float32)
        padded_hidden[:count] = hidden
        tokens = np.zeros(batch, np.int64)
        tokens[:count] = last_tokens
        out = self.backend.run(self.speculation.graph, {"hidden": padded_hidden, "last_token": tokens})
        return out["draft_tokens"][:count], out["draft_scores"][:count]


class GreedyDecodeLoop:
    """Greedy decode calls in a row over cache rows [start, start + batch), with every input and output of the
    decode phase in arrays of its own, bound once and refilled in place: a call binds only its attention bias (whose
    length grows). Between two calls only the argmax goes back in, so the Python between them is a few array
    operations, where a whole engine step (schedule, sample, detokenize, stop checks) pays its cache misses again
    after every call's weights stream through the caches (docs/measurements.md)."""

    def __init__(self, executor: Executor, start: int, batch: int) -> None:
        self.input_ids = np.zeros((batch, 1), np.int64)
        self.past_lens = np.zeros(batch, np.int64)  # also the positions input: a one-token row sits at its past length
        self.query_lens = np.zeros(batch, np.int64)
        outputs = executor._output_arrays(batch, 1)
        self.argmax = outputs["argmax"]
        # every bias a decode call needs is zeros (a row sees its whole past): one buffer viewed at each call's length
        self.zero_bias = np.zeros(batch * (executor.max_seq_len + 1), np.float32)
        self.bound = executor.backend.bind(
            executor.decode_phase.graph,
            executor._cache_buffers(start, start + batch)
            | outputs
            | {
                "input_ids": self.input_ids,
                "positions": self.past_lens.reshape(batch, 1),
                "past_lens": self.past_lens,
                "query_lens": self.query_lens,
                "logits_index": np.zeros((batch, 1), np.int64),
            },
        )

    def run(
        self, rows: list[int], token_ids: list[int], positions: list[int], steps: int, stop: np.ndarray
    ) -> np.ndarray:
        index = np.asarray(rows)
        for array in (self.input_ids, self.past_lens, self.query_lens):
            array.fill(0)  # rows left out take no part
        self.input_ids[index, 0] = token_ids
        self.past_lens[index] = positions
        self.query_lens[index] = 1
        batch, length = len(self.past_lens), int(self.past_lens.max()) + 1
        tokens = np.empty((len(rows), steps), np.int64)
        for step in range(steps):
            self.bound.run({"attention_bias": self.zero_bias[: batch * length].reshape(batch, 1, 1, length)}, {})
            chosen = self.argmax[index, 0]
            if stop[chosen].any():
                return tokens[:, :step]
            tokens[:, step] = chosen
            self.input_ids[index, 0] = chosen
            self.past_lens[index] += 1
            length += 1
        return tokens


@dataclass(frozen=True)
class Scored:
    """What the step graph computes for the tokens that get logits (leading axes: rows, tokens)."""

    logits: np.ndarray  # [..., vocab]
    argmax: np.ndarray  # [...] int64: each logits row's argmax, greedy decoding's token when nothing adjusts it
    hidden: np.ndarray  # [..., hidden]: final-normed hidden state (where a draft head starts from)

    def __getitem__(self, index) -> Scored:
        """The same rows / tokens of all three."""
        return Scored(self.logits[index], self.argmax[index], self.hidden[index])


def bucket_for(value: int, buckets: list[int]) -> int:
    index = bisect.bisect_left(buckets, value)
    if index == len(buckets):
        raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


def _select(rows: list[int]) -> slice | list[int]:
    """Index of `rows` in a batch: a slice (a view, no copy of their logits) when they are consecutive."""
    return slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else rows


def _headroom(phases: list[PhaseSpec]) -> int:
    """The most padding tokens a call puts after a row's cached and real positions (the kernel wants room for them):
    a batched call may pad a one-token row to the largest token bucket; a one-row call (a prompt chunk) pads only
    to the next bucket."""

    def most_padding(steps: list[int]) -> int:
        return max(b - a for a, b in zip([0] + steps, steps)) - 1

    return max(max(p.steps) if max(p.batch_sizes) > 1 else most_padding(p.steps) for p in phases)
