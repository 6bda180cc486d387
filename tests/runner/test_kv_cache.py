"""The runner-owned KV cache: bucket sizing with headroom, contents kept across re-sizes, zero-copy views, keeping
the accepted nodes of a verified tree."""

import numpy as np

from engines.format import KVCacheSpec
from runner.kv_cache import KVCache

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
HEADROOM = 3


def filled_cache() -> tuple[KVCache, np.ndarray]:
    cache = KVCache(SPEC, [1, 2, 4], [8, 16, 32, 64], HEADROOM)
    cache.fit(2, 5)
    contents = np.random.default_rng(0).random((2, 2, 2, 5, 4), dtype=np.float32)  # [layers, rows, kvh, 5, D]
    cache.keys[:, :, :, :5] = contents
    cache.values[:, :, :, :5] = contents + 1
    return cache, contents


def test_buffers_have_headroom_past_the_length_bucket():
    cache, _ = filled_cache()
    assert (cache.rows, cache.length) == (2, 8)
    assert cache.keys.shape == cache.values.shape == (2, 2, 2, 8 + HEADROOM, 4)


def test_growth_keeps_contents_and_rows_never_shrink():
    cache, contents = filled_cache()
    generation = cache.generation
    cache.fit(3, 20)
    assert (cache.rows, cache.length) == (4, 32) and cache.generation != generation
    np.testing.assert_array_equal(cache.keys[:, :2, :, :5], contents)
    np.testing.assert_array_equal(cache.values[:, :2, :, :5], contents + 1)
    cache.fit(1, 20)
    assert cache.rows == 4


def test_length_shrinks_only_to_half_or_less():
    cache = KVCache(SPEC, [1, 2], [8, 16, 32, 48, 64], HEADROOM)
    cache.fit(2, 5)
    cache.values[:, 1, :, :5] = 7.0
    cache.fit(2, 60)
    assert cache.length == 64
    generation = cache.generation
    cache.fit(2, 40)  # needs 48: more than half of 64, so no re-size
    assert cache.length == 64 and cache.generation == generation
    cache.fit(2, 20)  # needs 32: half of 64
    assert cache.length == 32
    assert (cache.values[:, 1, :, :5] == 7.0).all()


def test_views_are_contiguous_and_zero_copy():
    cache, _ = filled_cache()
    keys, values = cache.views(1, 2)
    assert all(np.shares_memory(k, cache.keys) and k.flags.c_contiguous and k.shape == (1, 2, 11, 4) for k in keys)
    assert all(np.shares_memory(v, cache.values) and v.flags.c_contiguous for v in values)


def test_keep_moves_the_accepted_nodes_down_in_path_order():
    cache, contents = filled_cache()
    # a verify call wrote nodes 0..3 of a tree at positions 1..4; the path 0 -> 2 -> 3 is accepted
    cache.keep(1, 1, [0, 2, 3])
    np.testing.assert_array_equal(cache.keys[:, 1, :, 1:4], contents[:, 1, :, [1, 3, 4]].transpose(1, 2, 0, 3))
    np.testing.assert_array_equal(cache.values[:, 1, :, 0], contents[:, 1, :, 0] + 1)  # before the tree: untouched
    np.testing.assert_array_equal(cache.keys[:, 0, :, :5], contents[:, 0])  # other rows untouched


def test_release_frees_the_buffers():
    cache, _ = filled_cache()
    cache.release()
    assert cache.nbytes == 0 and cache.rows == 0
