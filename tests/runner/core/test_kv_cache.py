"""The runner-owned KV cache: sized once with headroom and page-aligned rows, zero-copy views, pages handed back per
row, keeping the accepted nodes of a verified tree."""

import mmap

import numpy as np

from engines.format import KVCacheSpec
from runner.core.kv_cache import KVCache

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
HEADROOM = 3


def filled_cache() -> tuple[KVCache, np.ndarray]:
    cache = KVCache(SPEC, rows=4, length=60, headroom=HEADROOM)
    contents = np.random.default_rng(0).random((2, 2, 2, 5, 4), dtype=np.float32)  # [layers, rows, kvh, 5, D]
    cache.keys[:, :2, :, :5] = contents
    cache.values[:, :2, :, :5] = contents + 1
    return cache, contents


def test_every_row_has_the_longest_sequence_plus_headroom_in_whole_pages():
    cache, _ = filled_cache()
    assert cache.keys.shape == cache.values.shape == (2, 4, 2, cache.positions, 4)
    assert cache.positions >= 60 + HEADROOM
    row_bytes = cache.keys[0, 0].nbytes
    assert row_bytes % mmap.PAGESIZE == 0  # so one row's pages can be handed back alone
    assert cache.positions - (60 + HEADROOM) < mmap.PAGESIZE // (2 * 4 * 4)


def test_only_written_pages_are_memory_and_a_freed_row_gives_them_back():
    cache = KVCache(SPEC, rows=4, length=4096, headroom=HEADROOM)
    assert cache.resident_bytes() == 0  # address space only
    cache.keys[:, 1, :, :100] = 1.0
    cache.values[:, 1, :, :100] = 2.0
    cache.keys[:, 2, :, :10] = 3.0
    written = cache.resident_bytes()
    assert 0 < written < cache.keys.nbytes // 10
    cache.free_row(1)
    assert 0 < cache.resident_bytes() < written
    assert not cache.keys[:, 1].any() and (cache.keys[:, 2, :, :10] == 3.0).all()  # only row 1 was handed back
    cache.release()
    assert cache.resident_bytes() == 0


def test_views_are_contiguous_and_zero_copy():
    cache, _ = filled_cache()
    keys, values = cache.views(1, 2)
    assert all(
        np.shares_memory(k, cache.keys) and k.flags.c_contiguous and k.shape == (1, 2, cache.positions, 4) for k in keys
    )
    assert all(np.shares_memory(v, cache.values) and v.flags.c_contiguous for v in values)


def test_keep_moves_the_accepted_nodes_down_in_path_order():
    cache, contents = filled_cache()
    # a verify call wrote nodes 0..3 of a tree at positions 1..4; the path 0 -> 2 -> 3 is accepted
    cache.keep(1, 1, [0, 2, 3])
    np.testing.assert_array_equal(cache.keys[:, 1, :, 1:4], contents[:, 1, :, [1, 3, 4]].transpose(1, 2, 0, 3))
    np.testing.assert_array_equal(cache.values[:, 1, :, 0], contents[:, 1, :, 0] + 1)  # before the tree: untouched
    np.testing.assert_array_equal(cache.keys[:, 0, :, :5], contents[:, 0])  # other rows untouched
    # a path along the first nodes (a chain) is already in place: nothing moves
    cache, contents = filled_cache()
    cache.keep(1, 1, [0, 1, 2])
    cache.keep(1, 4, [0])
    np.testing.assert_array_equal(cache.keys[:, :2, :, :5], contents)
    cache.keep(1, 1, [0, 1, 3])  # only the last node moves
    np.testing.assert_array_equal(cache.keys[:, 1, :, 3], contents[:, 1, :, 4])
    np.testing.assert_array_equal(cache.keys[:, 1, :, :3], contents[:, 1, :, :3])
    np.testing.assert_array_equal(cache.values[:, 1, :, 3], contents[:, 1, :, 4] + 1)


def test_copy_prefix_copies_the_first_positions_of_one_row_into_another():
    cache, contents = filled_cache()
    cache.copy_prefix(source_row=1, target_row=3, length=4)
    np.testing.assert_array_equal(cache.keys[:, 3, :, :4], contents[:, 1, :, :4])
    np.testing.assert_array_equal(cache.values[:, 3, :, :4], contents[:, 1, :, :4] + 1)
    assert not cache.keys[:, 3, :, 4:].any()  # nothing past the prefix


def test_device_cache_keeps_and_copies_as_the_host_cache_does():
    """DeviceKVCache (the GPU backends' cache) against KVCache, run on CPU tensors."""
    import torch

    from runner.core.kv_cache import DeviceKVCache

    host, device = KVCache(SPEC, rows=2, length=60, headroom=HEADROOM), DeviceKVCache(SPEC, 2, 60, HEADROOM, "cpu")
    rng = np.random.default_rng(0)
    values = rng.standard_normal(host.keys[:, :, :, :20].shape).astype(host.keys.dtype)
    host.keys[:, :, :, :20] = values
    device.keys[:, :, :, :20] = torch.from_numpy(values)
    for cache in (host, device):
        cache.keep(0, 4, [0, 2, 5])
        cache.copy_prefix(0, 1, 10)
    np.testing.assert_array_equal(device.keys[:, :, :, :20].numpy(), host.keys[:, :, :, :20])
    assert [tuple(v.shape[:2]) for v in device.views(0, 2)[0]] == [v.shape[:2] for v in host.views(0, 2)[0]]
    assert device.positions == 60 + HEADROOM  # (the host rounds rows up to whole pages)
