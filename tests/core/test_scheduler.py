"""Scheduler behaviour on fake model outputs (pure Python, runs in milliseconds)."""

import pytest

from helpers.factories import make_request, make_scheduler
from qwenserve.core.sched_output import ModelOutput, SampledToken
from qwenserve.request import RequestStatus


def run_step(sched, token=7):
    out = sched.schedule()
    sampled = {c.request_id: SampledToken(token) for c in out.chunks if c.sample}
    return out, sched.update(out, ModelOutput(sampled))


def test_long_prompt_is_chunked_under_the_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    req = make_request(num_tokens=20, max_tokens=2)
    sched.add_request(req)
    sizes = []
    for _ in range(3):
        out, _ = run_step(sched)
        sizes.append([len(c.token_ids) for c in out.chunks])
        assert out.num_scheduled_tokens <= 8
    assert sizes == [[8], [8], [4]]
    assert [c.sample for c in out.chunks] == [True] and req.num_output_tokens == 1


def test_decodes_and_prefills_share_one_budget_running_first():
    sched = make_scheduler(max_num_batched_tokens=10)
    a = make_request(num_tokens=4, max_tokens=5)
    sched.add_request(a)
    run_step(sched)
    b = make_request(num_tokens=30, max_tokens=5)
    sched.add_request(b)
    out, _ = run_step(sched)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [
        (a.request_id, 1), (b.request_id, 9)]
    assert [n.request_id for n in out.new_requests] == [b.request_id]


def test_max_num_seqs_limits_the_batch():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    reqs = [make_request(num_tokens=3) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    out, _ = run_step(sched)
    assert len(out.chunks) == 2 and len(sched.waiting) == 1


def test_preemption_frees_the_newest_and_recomputes_it_without_loss():
    sched = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=64)
    a = make_request(num_tokens=4, max_tokens=6)
    b = make_request(num_tokens=4, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # a, b take 2 blocks each
    preempted = []
    for _ in range(20):
        out, _ = run_step(sched)
        preempted += out.preempted_request_ids
        if not sched.has_unfinished_requests():
            break
    assert preempted and preempted[0] == b.request_id
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert b.num_preemptions >= 1 and sched.num_preemptions == len(preempted)
    assert sched.cache.usage() == 0.0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_resumed_request_recomputes_prompt_and_outputs(prefix_caching):
    sched = make_scheduler(num_blocks=5, block_size=2, max_num_batched_tokens=64,
                           enable_prefix_caching=prefix_caching)
    a = make_request(num_tokens=4, max_tokens=5)  # 9 tokens: 5 blocks alone, 10 for both
    b = make_request(num_tokens=4, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    resumed = None
    for _ in range(30):
        out, _ = run_step(sched)
        for new in out.new_requests:
            if new.output_token_ids:
                resumed = new
                chunk = next(c for c in out.chunks if c.request_id == new.request_id)
                everything = new.prompt_token_ids + new.output_token_ids
                # recomputed from its start, or from what the prefix cache still holds
                assert chunk.start_pos % 2 == 0 and chunk.start_pos < len(everything)
                assert chunk.token_ids == everything[chunk.start_pos:]
        if not sched.has_unfinished_requests():
            break
    assert resumed is not None
    assert a.num_output_tokens == b.num_output_tokens == 5


def test_stop_conditions():
    sched = make_scheduler()
    eos = make_request(num_tokens=3, max_tokens=10)
    eos.sampling_params.all_stop_token_ids = {7}
    stop_tok = make_request(num_tokens=3, max_tokens=10, stop_token_ids=[7])
    stop_tok.sampling_params.all_stop_token_ids = {7}
    length = make_request(num_tokens=3, max_tokens=2)
    for r in (eos, stop_tok, length):
        sched.add_request(r)
    run_step(sched, token=7)
    run_step(sched, token=7)
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop_tok.status == RequestStatus.FINISHED_STOPPED and stop_tok.stop_reason == 7
    assert length.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_min_tokens_delays_stop_and_max_model_len_caps():
    sched = make_scheduler(max_model_len=6)
    r = make_request(num_tokens=3, max_tokens=10, min_tokens=2)
    r.sampling_params.all_stop_token_ids = {7}
    sched.add_request(r)
    run_step(sched, token=7)
    assert not r.is_finished  # one token < min_tokens
    run_step(sched, token=7)
    assert r.status == RequestStatus.FINISHED_STOPPED
    capped = make_request(num_tokens=4, max_tokens=10)
    sched.add_request(capped)
    for _ in range(5):
        run_step(sched, token=1)
    assert capped.status == RequestStatus.FINISHED_LENGTH_CAPPED and capped.num_tokens == 6


def test_abort_frees_blocks_anywhere_and_reports_to_workers():
    sched = make_scheduler(max_num_seqs=1)
    running = make_request(num_tokens=5)
    waiting = make_request(num_tokens=5)
    sched.add_request(running)
    sched.add_request(waiting)
    run_step(sched)
    sched.finish_requests([running.request_id, waiting.request_id],
                          RequestStatus.FINISHED_ABORTED)
    assert sched.cache.usage() == 0.0 and not sched.has_unfinished_requests()
    out = sched.schedule()
    assert set(out.finished_request_ids) == {running.request_id, waiting.request_id}


def test_prefix_hit_skips_cached_tokens_and_is_counted():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64)
    a = make_request(prompt=list(range(13)), max_tokens=1)
    sched.add_request(a)
    run_step(sched)
    b = make_request(prompt=list(range(13)), max_tokens=1)
    sched.add_request(b)
    out, _ = run_step(sched)
    assert out.chunks[0].start_pos == 12 and len(out.chunks[0].token_ids) == 1
    assert b.num_cached_tokens == 12
    stats = sched.stats()
    assert stats.prefix_cache_queries == 26 and stats.prefix_cache_hits == 12


def test_fcfs_blocked_head_blocks_the_queue():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    big = make_request(num_tokens=20)  # needs 5 blocks: never fits while others run
    small = make_request(num_tokens=2)
    running = make_request(num_tokens=4, max_tokens=50)
    sched.add_request(running)
    run_step(sched)
    sched.add_request(big)
    sched.add_request(small)
    out, _ = run_step(sched)
    assert [c.request_id for c in out.chunks] == [running.request_id]


def test_hybrid_prefill_saves_its_checkpoint_mid_chunk_and_a_follow_up_restores_it():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64, num_state_slots=4)
    first = make_request(prompt=list(range(14)), max_tokens=2)
    sched.add_request(first)
    out, _ = run_step(sched)
    live = sched.cache.state_slot(first.request_id)
    # the whole prompt runs in one chunk; the kernels also save the states after 12 tokens (the
    # last block boundary before the last token) into an idle slot, registered after the step
    ((chunk),) = out.chunks
    assert (chunk.start_pos, len(chunk.token_ids), chunk.sample) == (0, 14, True)
    n, checkpoint = chunk.state_checkpoint
    assert n == 12 and checkpoint not in (0, live)
    assert not out.state_saves and not out.state_restores
    out, _ = run_step(sched)
    assert [(c.start_pos, len(c.token_ids), c.state_checkpoint) for c in out.chunks] == \
        [(14, 1, None)]
    assert not out.state_saves
    while sched.has_unfinished_requests():
        run_step(sched)
    follow_up = make_request(prompt=list(range(14)) + [7, 50, 51, 52, 53], max_tokens=1)
    sched.add_request(follow_up)
    out, _ = run_step(sched)
    ((restored_from, restored_into),) = out.state_restores
    assert restored_from == checkpoint
    ((chunk),) = out.chunks
    # from the checkpoint to the end, saving again at 16 (4 tokens in) into another idle slot
    assert (chunk.start_pos, len(chunk.token_ids)) == (12, 7)
    assert chunk.state_checkpoint[0] == 4
    assert chunk.state_checkpoint[1] not in (0, checkpoint, restored_into)
    assert follow_up.num_cached_tokens == 12
