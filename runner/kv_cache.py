"""The static KV cache the runner owns and feeds to every graph call.

Buffers are sized to a (batch bucket, KV-length bucket) pair and re-sized only when the needed buckets grow (or
the length can halve), so each step feeds graph inputs that are plain views of them (no copy) and its attention
cost follows the KV-length bucket in use, not the engine's maximum. The graphs return only the new tokens' K/V, written here in
place. Layouts (per layer): keys [rows, kv_heads, head_dim, length], values [rows, kv_heads, length, head_dim].
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
    def __init__(self, spec: KVCacheSpec, row_buckets: list[int], length_buckets: list[int]) -> None:
        self.spec = spec
        self.row_buckets = sorted(row_buckets)
        self.length_buckets = sorted(length_buckets)
        self.dtype = np.dtype(spec.dtype)
        self.keys = self._alloc_keys(0, 0)
        self.values = self._alloc_values(0, 0)

    @property
    def rows(self) -> int:
        return self.keys.shape[1]

    @property
    def length(self) -> int:
        return self.keys.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def _alloc_keys(self, rows: int, length: int) -> np.ndarray:
        s = self.spec
        return np.zeros((s.num_layers, rows, s.num_kv_heads, s.head_dim, length), self.dtype)

    def _alloc_values(self, rows: int, length: int) -> np.ndarray:
        s = self.spec
        return np.zeros((s.num_layers, rows, s.num_kv_heads, length, s.head_dim), self.dtype)

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
        keys, values = self._alloc_keys(rows, length), self._alloc_values(rows, length)
        keep_rows, keep_len = min(rows, self.rows), min(length, self.length)
        keys[:, :keep_rows, :, :, :keep_len] = self.keys[:, :keep_rows, :, :, :keep_len]
        values[:, :keep_rows, :, :keep_len] = self.values[:, :keep_rows, :, :keep_len]
        self.keys, self.values = keys, values

    def release(self) -> None:
        """Give the memory back (nothing is cached any more)."""
        self.keys, self.values = self._alloc_keys(0, 0), self._alloc_values(0, 0)

    def views(self, start_row: int, stop_row: int, length: int | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per-layer caches of rows [start_row, stop_row): views of the buffers (no copy) at the full length, or
        contiguous copies of the first `length` positions (a prefill chunk needs only what is already cached,
        and attending over the whole buffer would cost it far more than the copy)."""
        layers = range(self.spec.num_layers)
        keys = [self.keys[i, start_row:stop_row] for i in layers]
        values = [self.values[i, start_row:stop_row] for i in layers]
        if length is not None and length < self.length:
            keys = [np.ascontiguousarray(k[..., :length]) for k in keys]
            values = [np.ascontiguousarray(v[:, :, :length]) for v in values]
        return keys, values

    def write(self, row: int, start: int, new_keys: np.ndarray, new_values: np.ndarray) -> None:
        """Store the K/V of n new tokens of one row: new_* are [layers, n, kv_heads, head_dim] (the graph's output)."""
        count = new_keys.shape[1]
        self.keys[:, row, :, :, start:start + count] = new_keys.transpose(0, 2, 3, 1)
        self.values[:, row, :, start:start + count] = new_values.transpose(0, 2, 1, 3)
