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


def test_state_slots_one_per_live_request():
    cm = CacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False, num_state_slots=3)
    a, b, c = (make_request(num_tokens=2) for _ in range(3))
    assert cm.allocate(a, 2) is not None and cm.allocate(b, 2) is not None
    assert cm.allocate(c, 2) is None  # slot 0 is the null slot: only 2 usable
    assert {cm.state_slot(a.request_id), cm.state_slot(b.request_id)} == {1, 2}
    cm.free(a)
    assert cm.allocate(c, 2) is not None and cm.state_slot(c.request_id) == cm.state_slots.get(
        c.request_id)


def hybrid(num_state_slots: int = 4, num_blocks: int = 16) -> CacheManager:
    return CacheManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=True,
                        num_state_slots=num_state_slots)


def run_prefill(cm: CacheManager, req, upto: int) -> tuple[int, int] | None:
    """Allocate and 'compute' req up to ``upto`` tokens; returns the state save it triggers."""
    cm.allocate(req, upto - req.num_computed_tokens)
    req.num_computed_tokens = upto
    cm.cache_full_blocks(req)
    return cm.save_state(req, upto)


def test_hybrid_prefix_hit_needs_a_state_checkpoint():
    cm = hybrid()
    first = make_request(prompt=list(range(14)))
    assert cm.checkpoint_position(first) == 12  # last block boundary before the last token
    live, saved = run_prefill(cm, first, 12)
    assert live == cm.state_slot(first.request_id) and saved != live
    run_prefill(cm, first, 14)
    cm.free(first)
    follow_up = make_request(prompt=list(range(14)) + [50, 51, 52])  # e.g. the next chat turn
    hit = cm.lookup_prefix(follow_up)
    assert len(hit) == 3  # 4 KV blocks would match up to 16, the state only up to 12
    assert cm.checkpoint_slot(follow_up, len(hit)) == saved
    assert cm.allocate(follow_up, 5, hit, keep_slot=saved) is not None
    assert cm.state_slot(follow_up.request_id) != saved  # the checkpoint is copied, not taken
    assert cm.restore_state(follow_up, saved) == (saved, cm.state_slot(follow_up.request_id))
    other = make_request(prompt=list(range(8)) + [99] * 8)  # shares 2 blocks, no checkpoint
    assert cm.lookup_prefix(other) == []


def test_checkpoints_live_in_idle_slots_and_are_evicted_lru():
    cm = hybrid(num_state_slots=4)  # 3 usable slots
    reqs = [make_request(prompt=[i] * 9) for i in range(3)]
    saves = []
    for req in reqs:
        saves.append(run_prefill(cm, req, 8))
        cm.free(req)
    # Three requests came and went, one at a time, each holding one slot while it ran: two idle
    # slots were left for checkpoints, so the third save evicted the oldest checkpoint.
    assert all(s is not None for s in saves)
    hits = [cm.lookup_prefix(make_request(prompt=[i] * 10)) for i in range(3)]
    assert [len(h) for h in hits] == [0, 2, 2]
    assert cm.checkpoint_slot(make_request(prompt=[2] * 10), 2) == saves[2][1]
    live = [make_request(num_tokens=2) for _ in range(3)]
    for req in live:
        assert cm.allocate(req, 2) is not None  # live requests evict checkpoints, never wait
    assert all(cm.lookup_prefix(make_request(prompt=[i] * 10)) == [] for i in range(3))
    assert cm.save_state(live[0], 4) is None  # no idle slot left for a checkpoint


def test_reset_prefix_cache_drops_checkpoints():
    cm = hybrid()
    req = make_request(prompt=list(range(9)))
    assert run_prefill(cm, req, 8) is not None
    cm.free(req)
    assert cm.reset_prefix_cache()
    assert cm.lookup_prefix(make_request(prompt=list(range(9)))) == []


def test_one_step_never_saves_two_checkpoints_into_one_slot():
    cm = hybrid(num_state_slots=4)  # 3 usable: two live below, one idle
    a, b = make_request(prompt=[1] * 9), make_request(prompt=[2] * 9)
    for req in (a, b):
        cm.allocate(req, 8)
        req.num_computed_tokens = 8
        cm.cache_full_blocks(req)
    first = cm.save_state(a, 8)
    assert first is not None
    assert cm.save_state(b, 8, taken={first[1]}) is None  # the only idle slot is taken
    assert cm.checkpoint_slot(make_request(prompt=[1] * 9), 2) == first[1]
