from __future__ import annotations

import pytest

from ds4d.cache.blocks import BlockPool, block_keys


def test_keys_chain_and_namespace():
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, b"m")
    assert len(a) == 2
    b = block_keys([1, 2, 3, 4, 5, 6, 7, 0], 4, b"m")
    assert a[0] == b[0] and a[1] != b[1]
    assert block_keys([1, 2, 3, 4], 4, b"other")[0] != a[0]
    # a block's key depends on everything before it
    assert block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, b"m")[1] != a[1]


def test_allocate_release_and_reuse_lru_order():
    pool = BlockPool(4, 2)
    blocks = pool.allocate(4)
    assert blocks == [0, 1, 2, 3] and pool.num_free == 0
    assert pool.allocate(1) is None
    keys = block_keys([1, 2, 3, 4], 2, b"")
    pool.register(0, keys[0], [1, 2])
    pool.register(1, keys[1], [3, 4])
    pool.release([0, 1])           # released tail first: block 1 is older in the LRU
    pool.release([2, 3])
    assert pool.num_free == 4 and pool.num_cached == 2
    fresh = pool.allocate(3)       # the two plain free blocks first, then evict the LRU cached block
    assert sorted(fresh[:2]) == [2, 3] and fresh[2] == 1
    assert pool.evictions == 1
    m = pool.match([1, 2, 3, 4], keys)
    assert m.block_ids == [0]      # block 1 was evicted; the chain stops there


def test_match_verifies_tokens():
    pool = BlockPool(2, 2)
    keys = block_keys([1, 2], 2, b"")
    [b] = pool.allocate(1)
    pool.register(b, keys[0], [7, 7])  # a key whose stored tokens differ (as after a collision)
    assert pool.match([1, 2], keys).block_ids == []


def test_acquire_shares_and_double_release_is_caught():
    pool = BlockPool(2, 2)
    keys = block_keys([5, 6], 2, b"")
    [b] = pool.allocate(1)
    pool.register(b, keys[0], [5, 6])
    m = pool.match([5, 6], keys)
    pool.acquire(m)
    assert pool.ref_count(b) == 2
    pool.release([b])
    pool.release([b])
    assert pool.num_cached == 1
    with pytest.raises(AssertionError):
        pool.release([b])


def test_prefix_caching_off_never_matches():
    pool = BlockPool(2, 2, prefix_caching=False)
    keys = block_keys([5, 6], 2, b"")
    [b] = pool.allocate(1)
    pool.register(b, keys[0], [5, 6])
    pool.release([b])
    assert pool.num_cached == 0 and pool.match([5, 6], keys).block_ids == []
