"""The static KV cache the runner owns and binds to every graph call.

One buffer for K and one for V, `[layers, rows, kv_heads, positions, head_dim]`, sized once for every row the engine
batches at its longest sequence, and never moved: the graph bindings are made once, and no step ever waits for a
re-size (growing bucket-sized buffers copied the cache into fresh pages, stalling every stream:
docs/measurements.md). The size is only address space: a page becomes memory when a row first writes it,
and a finished row's pages are handed back to the system at once (madvise), so memory follows what the running
rows hold. Pages are small ones on purpose: with transparent huge pages a row's first token would make 2 MB per
layer resident.

Each graph call binds per-layer views of the rows it covers as its cache inputs *and* outputs: the fused attention
writes the new tokens' K/V in place and reads only the positions each row holds, so a step costs what the rows
hold, not what the buffer could hold. Calls are padded (to a batch bucket and a token bucket), but padding never
enters the cache: the graph writes only each row's real tokens, and rows a batched call passes over are left as
they are. Every row has `headroom` positions past the longest sequence, because the kernel wants room for a row's
whole padded chunk.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import numpy as np

from engines.format import KVCacheSpec


def make_kv_cache(spec: KVCacheSpec, rows: int, length: int, headroom: int, device: str = "cpu"):
    """The cache in host memory (KVCache), or in the GPU's (DeviceKVCache) for a backend that runs there."""
    if device == "cpu":
        return KVCache(spec, rows, length, headroom)
    return DeviceKVCache(spec, rows, length, headroom, device)


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a cache of `dtype` is kept in: bfloat16, which numpy lacks, as its 16 bits."""
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


class CacheRows:
    """What every cache does with its `keys` and `values` buffers, [layers, rows, kv_heads, positions, head_dim]
    numpy arrays (KVCache) or device tensors (DeviceKVCache): the same indexing serves both."""

    spec: KVCacheSpec

    @property
    def rows(self) -> int:
        return self.keys.shape[1]

    def views(self, start_row: int, stop_row: int) -> tuple[list, list]:
        """Per-layer buffers of rows [start_row, stop_row): contiguous views, no copy."""
        layers = range(self.spec.num_layers)
        return [self.keys[i, start_row:stop_row] for i in layers], [self.values[i, start_row:stop_row] for i in layers]

    def keep(self, row: int, start: int, nodes: list[int]) -> None:
        """A verify call wrote its tree's nodes at start + node index; keep the accepted `nodes` (root first, in path
        order) as the positions start, start + 1, ... Node indices only grow along a path, so no copy overwrites a
        node still to be moved. Leading nodes already in place (the root, and a chain packed first) are not copied:
        a step that accepts nothing, or only those, copies nothing."""
        moved = next((depth for depth, node in enumerate(nodes) if node != depth), len(nodes))
        if moved == len(nodes):
            return
        source = [start + node for node in nodes[moved:]]
        for buffer in (self.keys[:, row], self.values[:, row]):  # [layers, kv_heads, positions, head_dim]
            buffer[:, :, start + moved : start + len(nodes)] = buffer[:, :, source]

    def copy_prefix(self, source_row: int, target_row: int, length: int) -> None:
        """Copy the K/V of positions [0, length) of one row into another (prefix caching)."""
        for buffer in (self.keys, self.values):
            buffer[:, target_row, :, :length] = buffer[:, source_row, :, :length]


class KVCache(CacheRows):
    def __init__(self, spec: KVCacheSpec, rows: int, length: int, headroom: int) -> None:
        self.spec = spec
        dtype = storage_dtype(spec.dtype)
        position_bytes = spec.num_kv_heads * spec.head_dim * dtype.itemsize
        # a row of one layer must fill whole pages, so that a finished row's pages can be handed back alone
        step = mmap.PAGESIZE // math.gcd(mmap.PAGESIZE, position_bytes)
        self.positions = -(-(length + headroom) // step) * step
        self._row_bytes = self.positions * position_bytes  # one layer's part of one row
        shape = (spec.num_layers, rows, spec.num_kv_heads, self.positions, spec.head_dim)
        self._maps = [_anonymous_map(spec.num_layers * rows * self._row_bytes) for _ in range(2)]
        self.keys, self.values = (np.frombuffer(m, dtype).reshape(shape) for m in self._maps)

    def free_row(self, row: int) -> None:
        """Hand the row's pages back (its request is gone; the next one writes before it reads)."""
        for layer in range(self.spec.num_layers):
            offset = (layer * self.rows + row) * self._row_bytes
            for buffer in self._maps:
                buffer.madvise(mmap.MADV_DONTNEED, offset, self._row_bytes)

    def release(self) -> None:
        """Hand every page back (nothing is cached any more)."""
        for buffer in self._maps:
            buffer.madvise(mmap.MADV_DONTNEED)

    def resident_bytes(self) -> int:
        """Memory the cache holds now: its pages that are resident (mincore)."""
        return sum(_resident_pages(m) for m in self._maps) * mmap.PAGESIZE


def _anonymous_map(size: int) -> mmap.mmap:
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    return buffer


def _resident_pages(buffer: mmap.mmap) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-len(buffer) // mmap.PAGESIZE)
    status = (ctypes.c_ubyte * pages)()
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(buffer)), status) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return int((np.frombuffer(status, np.uint8) & 1).sum())


class DeviceKVCache(CacheRows):
    """The same cache as device tensors, for a backend whose graphs run on a GPU (engines/backends/aoti.py): the
    same layout and CacheRows' methods, torch in place of numpy. Device memory is allocated whole at start (no
    pages to hand back), so freeing a row only forgets it."""

    def __init__(self, spec: KVCacheSpec, rows: int, length: int, headroom: int, device: str) -> None:
        import torch

        self.spec = spec
        self.positions = length + headroom
        shape = (spec.num_layers, rows, spec.num_kv_heads, self.positions, spec.head_dim)
        dtype = getattr(torch, spec.dtype)
        self.keys, self.values = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))

    def free_row(self, row: int) -> None:
        """Nothing to hand back: the next request in the row writes before it reads."""

    def release(self) -> None:
        """Nothing to hand back (see free_row)."""

    def resident_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()
