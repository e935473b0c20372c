from qwenserve.core.cache.block_pool import BlockPool


def test_allocate_free_and_usage():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    assert pool.num_free_blocks == 1 and pool.usage() == 0.75
    pool.free(blocks[::-1])
    assert pool.num_free_blocks == 4 and pool.usage() == 0.0


def test_cached_block_revived_until_evicted_lru():
    pool = BlockPool(3, enable_caching=True)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"ha")
    pool.cache(b, b"hb")
    pool.free([b, a])  # reverse order: a is freed last, so it is evicted last
    pool.free([c])
    assert pool.lookup(b"ha") == a and pool.lookup(b"hb") == b
    pool.touch([a])  # prefix hit revives a free block
    assert pool.ref_cnt[a] == 1 and pool.num_free_blocks == 2
    (new,) = pool.allocate(1)  # LRU front: b (freed first) is evicted
    assert new == b and pool.lookup(b"hb") is None and pool.lookup(b"ha") == a


def test_shared_block_needs_all_refs_dropped():
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.allocate(1)
    pool.touch([a])
    pool.free([a])
    assert pool.num_free_blocks == 1
    pool.free([a])
    assert pool.num_free_blocks == 2


def test_duplicate_hash_keeps_first_block_and_no_caching_when_disabled():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"h") and not pool.cache(b, b"h")
    assert pool.lookup(b"h") == a
    off = BlockPool(2, enable_caching=False)
    (x,) = off.allocate(1)
    assert not off.cache(x, b"h") and off.lookup(b"h") is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.allocate(1)
    pool.cache(a, b"h")
    assert not pool.reset_prefix_cache()
    pool.free([a])
    assert pool.reset_prefix_cache() and pool.lookup(b"h") is None
