"""The static KV cache the runner owns and binds to every graph call.

Buffers are sized to a (batch bucket, KV-length bucket) pair and re-sized only when the needed buckets grow (or
the length can halve). Each graph call binds per-layer views of them (no copy) as its cache inputs *and* outputs:
the fused attention writes the new tokens' K/V in place and reads only the positions each row holds, so a step
costs what the rows hold, not what the buffer could hold. Layout per layer, keys and values alike:
[rows, kv_heads, positions, head_dim].

Calls are padded (to a batch bucket and a token bucket), but padding never enters the cache: the graph writes
only each row's real tokens, and rows a batched call passes over are left as they are. Every buffer has
`headroom` positions past its length bucket, because the kernel wants room for a row's whole padded chunk.
"""

from __future__ import annotations

import bisect

import numpy as np

from engines.format import KVCacheSpec


def bucket_for(value: int, buckets: list[int]) -> int:
    index = bisect.bisect_left(buckets, value)
    if index == len(buckets):
        raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


class KVCache:
    def __init__(self, spec: KVCacheSpec, row_buckets: list[int], length_buckets: list[int], headroom: int) -> None:
        self.spec = spec
        self.row_buckets = sorted(row_buckets)
        self.length_buckets = sorted(length_buckets)
        self.headroom = headroom  # the most padding a call adds after a row's real tokens
        self.dtype = np.dtype(spec.dtype)
        self.generation = 0  # changes whenever the buffers are replaced (bindings of the old ones are stale)
        self._allocate(0, 0)

    @property
    def rows(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def _allocate(self, rows: int, length: int) -> None:
        s = self.spec
        shape = (s.num_layers, rows, s.num_kv_heads, length + self.headroom if rows else 0, s.head_dim)
        self.keys, self.values = np.zeros(shape, self.dtype), np.zeros(shape, self.dtype)
        self.length = length  # the length bucket: positions a row may hold
        self.generation += 1

    def fit(self, rows: int, length: int) -> None:
        """Make room for `rows` rows of `length` positions, keeping the cached contents.

        Rows only grow (a decode call reads just the rows it uses, so spare rows cost memory, not time). The
        length grows to the needed bucket at once and shrinks only to a bucket at most half the current one, so
        requests coming and going cannot make the buffers (hundreds of MB at 16 rows) flip back and forth."""
        rows = max(bucket_for(max(rows, 1), self.row_buckets), self.rows)
        needed = bucket_for(max(length, 1), self.length_buckets)
        length = needed if needed > self.length or 2 * needed <= self.length else self.length
        if (rows, length) == (self.rows, self.length):
            return
        keys, values = self.keys, self.values
        keep_rows, keep_len = min(rows, keys.shape[1]), min(length, self.length)
        self._allocate(rows, length)
        self.keys[:, :keep_rows, :, :keep_len] = keys[:, :keep_rows, :, :keep_len]
        self.values[:, :keep_rows, :, :keep_len] = values[:, :keep_rows, :, :keep_len]

    def release(self) -> None:
        """Give the memory back (nothing is cached any more)."""
        self._allocate(0, 0)

    def views(self, start_row: int, stop_row: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per-layer buffers of rows [start_row, stop_row): contiguous views, no copy."""
        layers = range(self.spec.num_layers)
        return [self.keys[i, start_row:stop_row] for i in layers], [self.values[i, start_row:stop_row] for i in layers]

    def keep(self, row: int, start: int, nodes: list[int]) -> None:
        """A verify call wrote its tree's nodes at start + node index; keep the accepted `nodes` (root first, in path
        order) as the positions start, start + 1, ... Node indices only grow along a path, so no copy overwrites a
        node still to be moved."""
        source = start + np.asarray(nodes)
        for buffer in (self.keys[:, row], self.values[:, row]):  # [layers, kv_heads, positions, head_dim]
            buffer[:, :, start:start + len(nodes)] = buffer[:, :, source]
