from helpers.factories import make_request
from qwenserve.core.cache.hashing import hash_block
from qwenserve.core.cache.manager import CacheManager


def test_allocation_rounds_up_to_blocks_and_fails_cleanly():
    cm = CacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    req = make_request(num_tokens=9)
    assert len(cm.allocate(req, 9)) == 3
    other = make_request(num_tokens=8)
    assert cm.allocate(other, 8) is None  # needs 2, 1 free: nothing changes
    assert cm.block_ids(other.request_id) == [] and cm.pool.num_free_blocks == 1
    req.num_computed_tokens = 9
    assert len(cm.allocate(req, 3)) == 0  # 12 tokens still fit in 3 blocks
    assert len(cm.allocate(req, 4)) == 1


def test_prefix_hit_reuses_full_blocks_and_leaves_one_token():
    cm = CacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = make_request(prompt=list(range(12)))
    cm.allocate(first, 12)
    first.num_computed_tokens = 12
    cm.cache_full_blocks(first)
    cm.free(first)
    same = make_request(prompt=list(range(12)))
    hit = cm.lookup_prefix(same)
    assert len(hit) == 2  # the 3rd block holds the last token, which must be recomputed
    longer = make_request(prompt=list(range(12)) + [99])
    assert len(cm.lookup_prefix(longer)) == 3
    different = make_request(prompt=[5] + list(range(1, 12)))
    assert cm.lookup_prefix(different) == []


def test_hashes_chain_over_the_whole_prefix():
    h0 = hash_block(None, [1, 2])
    assert hash_block(h0, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(None, [1, 2]) == h0


def test_revived_free_blocks_do_not_count_as_free_room():
    cm = CacheManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    a = make_request(prompt=[1, 2, 3, 4, 5])
    cm.allocate(a, 5)
    a.num_computed_tokens = 5
    cm.cache_full_blocks(a)
    cm.free(a)  # all 3 blocks free, 2 hold a cached prefix
    b = make_request(prompt=[1, 2, 3, 4, 7, 8, 9])
    hit = cm.lookup_prefix(b)
    assert len(hit) == 2
    # 7 tokens need 4 blocks: 2 shared + 2 new, but only 1 block is free besides the hit ones.
    assert cm.allocate(b, 3, hit) is None
    assert cm.pool.num_free_blocks == 3


def test_free_releases_blocks_and_prefix_stats_count_tokens():
    cm = CacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    r = make_request(num_tokens=4)
    cm.allocate(r, 4)
    cm.record_prefix_query(4, 2)
    cm.free(r)
    assert cm.usage() == 0.0 and cm.stats.queries == 4 and cm.stats.hits == 2


def test_state_slots_turn_prefix_caching_off():
    cm = CacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True, num_state_slots=3)
    assert not cm.enable_prefix_caching
    a, b, c = (make_request(num_tokens=2) for _ in range(3))
    assert cm.allocate(a, 2) is not None and cm.allocate(b, 2) is not None
    assert cm.allocate(c, 2) is None  # slot 0 is the null slot: only 2 usable
    assert {cm.state_slot(a.request_id), cm.state_slot(b.request_id)} == {1, 2}
    cm.free(a)
    assert cm.allocate(c, 2) is not None and cm.state_slot(c.request_id) == cm.state_slots.get(
        c.request_id)
