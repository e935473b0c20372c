from helpers.factories import make_request
from qwenserve.core.cache.hashing import hash_block
from qwenserve.core.cache.manager import NO_HIT, CacheManager


def test_allocation_rounds_up_to_blocks_and_fails_cleanly():
    cm = CacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    req = make_request(num_tokens=9)
    alloc = cm.allocate(req, 9)
    assert len(alloc.new_block_ids) == 3 and alloc.num_tokens == 9 and alloc.state_slot is None
    other = make_request(num_tokens=8)
    assert cm.allocate(other, 8) is None  # needs 2, 1 free: nothing changes
    assert cm.block_ids(other.request_id) == [] and cm.kv.pool.num_free_blocks == 1
    req.num_computed_tokens = 9
    assert len(cm.allocate(req, 3).new_block_ids) == 0  # 12 tokens still fit in 3 blocks
    assert len(cm.allocate(req, 4).new_block_ids) == 1


def test_prefix_hit_reuses_full_blocks_and_leaves_one_token():
    cm = CacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = make_request(prompt=list(range(12)))
    cm.allocate(first, 12)
    first.num_computed_tokens = 12
    cm.cache_full_blocks(first)
    cm.free(first)
    same = make_request(prompt=list(range(12)))
    hit = cm.lookup_prefix(same)
    # the 3rd block holds the last token, which must be recomputed
    assert len(hit.block_ids) == 2 and hit.num_tokens == 8 and hit.checkpoint_slot is None
    alloc = cm.allocate(same, 4, hit)
    assert alloc.new_block_ids[:2] == hit.block_ids and len(alloc.new_block_ids) == 3
    longer = make_request(prompt=list(range(12)) + [99])
    assert len(cm.lookup_prefix(longer).block_ids) == 3
    different = make_request(prompt=[5] + list(range(1, 12)))
    assert cm.lookup_prefix(different) == NO_HIT


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
    assert len(hit.block_ids) == 2
    # 7 tokens need 4 blocks: 2 shared + 2 new, but only 1 block is free besides the hit ones.
    assert cm.allocate(b, 3, hit) is None
    assert cm.kv.pool.num_free_blocks == 3 and cm.stats.queries == 0


def test_free_releases_blocks_and_prefix_stats_count_tokens():
    cm = CacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    r = make_request(num_tokens=4)
    cm.allocate(r, 4)
    r.num_computed_tokens = 4
    cm.cache_full_blocks(r)
    cm.free(r)
    again = make_request(num_tokens=4)
    assert cm.allocate(again, 2, cm.lookup_prefix(again)) is not None  # admitted: counted
    cm.free(again)
    assert cm.usage() == 0.0 and cm.stats.queries == 4 and cm.stats.hits == 2


def test_state_slots_one_per_live_request():
    cm = CacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False, num_state_slots=3)
    a, b, c = (make_request(num_tokens=2) for _ in range(3))
    assert cm.allocate(a, 2) is not None and cm.allocate(b, 2) is not None
    assert cm.allocate(c, 2) is None  # slot 0 is the null slot: only 2 usable
    assert {cm.state_slot(a.request_id), cm.state_slot(b.request_id)} == {1, 2}
    cm.free(a)
    alloc = cm.allocate(c, 2)
    assert alloc is not None and alloc.state_slot == cm.state_slot(c.request_id) == 1


def hybrid(num_state_slots: int = 4, num_blocks: int = 16) -> CacheManager:
    return CacheManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=True,
                        num_state_slots=num_state_slots)


def run_chunk(cm: CacheManager, req, num_tokens: int):
    """Allocate and 'compute' ``num_tokens`` more tokens of ``req`` (one step); returns the
    checkpoint the step's kernels were asked to save mid-chunk (position, slot), or None."""
    alloc = cm.allocate(req, num_tokens)
    assert alloc is not None and alloc.num_tokens == num_tokens
    planned = cm.planned_checkpoint(req.request_id)
    req.num_computed_tokens += num_tokens
    cm.cache_full_blocks(req)
    return None if planned is None else (planned.position, planned.slot)


def test_hybrid_prefix_hit_needs_a_state_checkpoint():
    cm = hybrid()
    first = make_request(prompt=list(range(14)))
    # one chunk; its states after 12 tokens (the last block boundary before the last token)
    # are saved mid-chunk into an idle slot
    position, checkpoint = run_chunk(cm, first, 14)
    live = cm.state_slot(first.request_id)
    assert position == 12 and checkpoint not in (0, live)
    assert run_chunk(cm, first, 1) is None  # a decode
    cm.free(first)
    follow_up = make_request(prompt=list(range(14)) + [50, 51, 52])  # e.g. the next chat turn
    hit = cm.lookup_prefix(follow_up)
    # 4 KV blocks would match up to 16 tokens, the state only up to 12
    assert len(hit.block_ids) == 3 and hit.checkpoint_slot == checkpoint
    alloc = cm.allocate(follow_up, 5, hit)
    # the checkpoint is copied into the request's own slot, not taken
    assert alloc.state_slot != checkpoint and not alloc.state_saves
    assert alloc.state_restores == [(checkpoint, alloc.state_slot)]
    # and this chunk saves its own at 16, never into the slot it restores from
    assert cm.planned_checkpoint(follow_up.request_id).slot not in (checkpoint, alloc.state_slot)
    other = make_request(prompt=list(range(8)) + [99] * 8)  # shares 2 blocks, no checkpoint
    assert cm.lookup_prefix(other) == NO_HIT


def test_a_chunk_ending_on_a_block_boundary_saves_with_the_next_allocation():
    cm = hybrid()
    first = make_request(prompt=list(range(14)))
    assert run_chunk(cm, first, 8) is None  # the budget cut it at 8, a boundary: no mid-save
    live = cm.state_slot(first.request_id)
    alloc = cm.allocate(first, 6)
    ((src, checkpoint),) = alloc.state_saves  # the live slot still holds the state after 8
    assert src == live and checkpoint != live
    assert cm.planned_checkpoint(first.request_id).slot not in (live, checkpoint)  # at 12
    assert cm.allocate(make_request(num_tokens=3), 3).state_saves == []  # drained once


def test_checkpoints_live_in_idle_slots_and_are_evicted_lru():
    cm = hybrid(num_state_slots=4)  # 3 usable slots
    reqs = [make_request(prompt=[i] * 9) for i in range(3)]
    for req in reqs:
        assert run_chunk(cm, req, 9)[0] == 8
        cm.free(req)
    # Three requests came and went, one at a time, each holding one slot while it ran: two idle
    # slots were left for checkpoints, so the third save evicted the oldest checkpoint.
    hits = [cm.lookup_prefix(make_request(prompt=[i] * 10)) for i in range(3)]
    assert [len(h.block_ids) for h in hits] == [0, 2, 2]
    live = [make_request(num_tokens=2) for _ in range(3)]
    for req in live:
        assert cm.allocate(req, 2) is not None  # live requests evict checkpoints, never wait
    assert all(cm.lookup_prefix(make_request(prompt=[i] * 10)) == NO_HIT for i in range(3))
    late = make_request(prompt=[7] * 9)
    cm.free(live[0])
    assert run_chunk(cm, late, 9) is None  # takes the only idle slot: no room for a checkpoint


def test_a_live_request_outranks_a_checkpoint_planned_for_the_step():
    cm = hybrid(num_state_slots=3)  # 2 usable: one live, one idle
    a = make_request(prompt=[1] * 9)
    cm.allocate(a, 9)
    planned = cm.planned_checkpoint(a.request_id)
    assert planned is not None and planned.position == 8  # the idle slot, reserved
    b = make_request(num_tokens=2)
    alloc = cm.allocate(b, 2)  # admitted later in the same step: takes it
    assert alloc is not None and alloc.state_slot == planned.slot
    assert cm.planned_checkpoint(a.request_id) is None
    a.num_computed_tokens = 9
    cm.cache_full_blocks(a)
    assert cm.lookup_prefix(make_request(prompt=[1] * 10)) == NO_HIT


def test_a_planned_checkpoint_goes_back_unregistered_when_its_request_leaves_first():
    cm = hybrid(num_state_slots=3)
    a = make_request(prompt=[1] * 9)
    cm.allocate(a, 9)
    slot = cm.planned_checkpoint(a.request_id).slot
    cm.free(a)  # preempted (or aborted) before the step's results came back
    assert cm.planned_checkpoint(a.request_id) is None
    assert cm.states.num_free_slots == 2 and slot in cm.states.idle
    assert cm.lookup_prefix(make_request(prompt=[1] * 10)) == NO_HIT


def test_reset_prefix_cache_drops_checkpoints():
    cm = hybrid()
    req = make_request(prompt=list(range(9)))
    run_chunk(cm, req, 9)
    cm.free(req)
    assert cm.reset_prefix_cache()
    assert cm.lookup_prefix(make_request(prompt=list(range(9)))) == NO_HIT
    assert cm.allocate(make_request(num_tokens=2), 2).state_saves == []


def test_one_step_never_saves_two_checkpoints_into_one_slot():
    cm = hybrid(num_state_slots=4)  # 3 usable: two live below, one idle
    a, b = make_request(prompt=[1] * 9), make_request(prompt=[2] * 9)
    for req in (a, b):
        cm.allocate(req, 8)
        req.num_computed_tokens = 8
    for req in (a, b):
        cm.cache_full_blocks(req)
    saves = cm.allocate(a, 1).state_saves
    assert len(saves) == 1 and saves[0][0] == cm.state_slot(a.request_id)  # b found no slot
    assert cm.lookup_prefix(make_request(prompt=[1] * 9)).checkpoint_slot == saves[0][1]


def test_two_requests_planning_one_checkpoint_register_it_once():
    cm = hybrid(num_state_slots=5)
    a, b = make_request(prompt=[3] * 9), make_request(prompt=[3] * 9)
    for req in (a, b):
        cm.allocate(req, 9)
    slots = {cm.planned_checkpoint(r.request_id).slot for r in (a, b)}
    assert len(slots) == 2
    for req in (a, b):
        req.num_computed_tokens = 9
        cm.cache_full_blocks(req)
    hit = cm.lookup_prefix(make_request(prompt=[3] * 10))
    assert hit.num_tokens == 8 and hit.checkpoint_slot in slots
    assert cm.states.num_free_slots == 2  # the duplicate's slot went back to the queue


def test_mtp_lookahead_slots_are_allocated_up_to_max_model_len():
    """MTP draft steps write the head's KV past the step's tokens: those slots come with the
    step's allocation, but never past max_model_len (a full-length request still fits)."""
    cm = CacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False,
                      num_lookahead_tokens=2, max_model_len=16)
    req = make_request(num_tokens=7)
    assert len(cm.allocate(req, 7).new_block_ids) == 3  # 7 + 2 slots -> 3 blocks
    req.num_computed_tokens = 7
    assert len(cm.allocate(req, 1).new_block_ids) == 0  # 8 + 2 -> still 3
    req.num_computed_tokens = 14
    assert len(cm.allocate(req, 2).new_block_ids) == 1  # 16 (+2 capped at 16) -> 4 blocks
