"""The runner-owned KV cache: bucket sizing, contents kept across re-sizes, zero-copy views."""

import numpy as np

from engines.format import KVCacheSpec
from runner.kv_cache import KVCache

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")


def filled_cache() -> KVCache:
    cache = KVCache(SPEC, [1, 2, 4], [8, 16, 32, 64])
    cache.fit(2, 5)
    keys = np.random.default_rng(0).random((2, 5, 2, 4), dtype=np.float32)  # [layers, n, kv_heads, head_dim]
    cache.write(1, 0, keys, keys + 1)
    return cache, keys


def test_write_places_tokens_in_both_layouts():
    cache, keys = filled_cache()
    np.testing.assert_array_equal(cache.keys[:, 1, :, :, :5], keys.transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(cache.values[:, 1, :, :5], (keys + 1).transpose(0, 2, 1, 3))


def test_growth_keeps_contents_and_rows_never_shrink():
    cache, keys = filled_cache()
    assert (cache.rows, cache.length) == (2, 8)
    cache.fit(3, 20)
    assert (cache.rows, cache.length) == (4, 32)
    np.testing.assert_array_equal(cache.keys[:, 1, :, :, :5], keys.transpose(0, 2, 3, 1))
    cache.fit(1, 20)
    assert cache.rows == 4


def test_length_shrinks_only_to_half_or_less():
    cache = KVCache(SPEC, [1, 2], [8, 16, 32, 48, 64])
    cache.fit(2, 5)
    keys = np.ones((2, 5, 2, 4), np.float32)
    cache.write(1, 0, keys, keys + 1)
    cache.fit(2, 60)
    assert cache.length == 64
    cache.fit(2, 40)  # needs 48: more than half of 64, so no re-size
    assert cache.length == 64
    cache.fit(2, 20)  # needs 32: half of 64
    assert cache.length == 32
    np.testing.assert_array_equal(cache.values[:, 1, :, :5], (keys + 1).transpose(0, 2, 1, 3))


def test_views_are_zero_copy_at_full_length_and_contiguous_prefixes_otherwise():
    cache, _ = filled_cache()
    keys, values = cache.views(0, 2)
    assert all(np.shares_memory(k, cache.keys) and k.flags.c_contiguous for k in keys)
    assert all(np.shares_memory(v, cache.values) and v.flags.c_contiguous for v in values)
    keys, values = cache.views(1, 2, length=4)
    assert keys[0].shape == (1, 2, 4, 4) and keys[0].flags.c_contiguous and not np.shares_memory(keys[0], cache.keys)
    np.testing.assert_array_equal(values[1], cache.values[1, 1:2, :, :4])


def test_release_frees_the_buffers():
    cache, _ = filled_cache()
    cache.release()
    assert cache.nbytes == 0 and cache.rows == 0
