"""Scheduler side of speculative decoding on fake model outputs (pure Python)."""

from helpers.factories import make_request
from qwenserve.config import SchedulerConfig
from qwenserve.core.cache.manager import CacheManager
from qwenserve.core.sched_output import ModelOutput, SampledToken
from qwenserve.core.scheduler import Scheduler


def make(k=3, budget=64, disable=None, num_blocks=64, max_model_len=256):
    cache = CacheManager(num_blocks, 4, True)
    return Scheduler(SchedulerConfig(16, budget, max_model_len, k, disable), cache)


def step(sched, accepted=0, drafts=None, token=7):
    """Accept the first ``accepted`` drafts of each verified chunk, then ``token``."""
    out = sched.schedule()
    mo = ModelOutput()
    for c in out.chunks:
        if c.sample:
            draft = c.token_ids[len(c.token_ids) - c.num_draft_tokens:]
            if draft[:accepted]:
                mo.accepted[c.request_id] = [SampledToken(t) for t in draft[:accepted]]
            mo.sampled[c.request_id] = SampledToken(token)
            mo.draft_token_ids[c.request_id] = list(drafts or [])
    return out, sched.update(out, mo)


def test_drafts_are_verified_and_rejected_kv_rolls_back():
    sched = make()
    req = make_request(num_tokens=5, max_tokens=20)
    sched.add_request(req)
    step(sched, drafts=[11, 12, 13])
    out, updates = step(sched, accepted=2, drafts=[21, 22, 23])
    (chunk,) = out.chunks
    assert chunk.token_ids == [7, 11, 12, 13] and chunk.num_draft_tokens == 3 and chunk.sample
    assert out.num_scheduled_tokens == 4  # the budget counts the drafts
    assert [u.new_token.token_id for u in updates] == [11, 12, 7]
    assert req.output_token_ids == [7, 11, 12, 7]
    assert req.num_computed_tokens == req.num_tokens - 1 == 8
    assert sched.spec_totals.num_accepted_tokens_per_pos == [1, 1, 0]
    out, _ = step(sched)
    assert out.chunks[0].start_pos == 8 and out.chunks[0].token_ids == [7, 21, 22, 23]


def test_drafts_trimmed_by_budget_max_tokens_and_batch_size():
    sched = make(budget=3)
    req = make_request(num_tokens=2, max_tokens=20)
    sched.add_request(req)
    step(sched, drafts=[1, 2, 3])
    out, _ = step(sched, drafts=[1, 2, 3])
    assert out.chunks[0].num_draft_tokens == 2  # 1 + 2 tokens fill the budget of 3
    sched = make()
    req = make_request(num_tokens=2, max_tokens=3)
    sched.add_request(req)
    step(sched, drafts=[1, 2, 3])
    out, updates = step(sched, accepted=3)
    # 2 tokens left: one draft at most, and the step emits 2 tokens then finishes
    assert out.chunks[0].num_draft_tokens == 1
    assert len(updates) == 2 and updates[-1].finished and req.num_output_tokens == 3
    sched = make(disable=2)
    reqs = [make_request(num_tokens=2, max_tokens=9) for _ in range(2)]
    for r in reqs:
        sched.add_request(r)
    step(sched, drafts=[1, 2])
    out, _ = step(sched)
    assert all(c.num_draft_tokens == 0 for c in out.chunks)


def test_stop_token_inside_the_accepted_drafts_truncates():
    sched = make()
    req = make_request(num_tokens=2, max_tokens=20, stop_token_ids=[5])
    req.sampling_params.all_stop_token_ids = {5}
    sched.add_request(req)
    step(sched, drafts=[4, 5, 6])
    out, updates = step(sched, accepted=3)
    assert [u.new_token.token_id for u in updates] == [4, 5]
    assert updates[-1].finished and req.output_token_ids == [7, 4, 5]
