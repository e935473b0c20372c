"""The scheduler's P/D bookkeeping (core/remote_kv.py), with no workers: a consumer's request
waits for its pull and resumes with all but its last prompt token computed; a failed or
aborted pull frees its blocks (an aborted one only once the pull ended); a producer's finished
request keeps its blocks until pulled or timed out."""

from __future__ import annotations

from helpers.factories import make_request
from qwenserve.config import SchedulerConfig
from qwenserve.core.cache.manager import CacheManager
from qwenserve.core.sched_output import ModelOutput, SampledToken
from qwenserve.core.scheduler import Scheduler
from qwenserve.kv_transfer.config import parse_kv_transfer_config
from qwenserve.kv_transfer.params import parse_kv_transfer_params
from qwenserve.request import RequestStatus

BS = 4


def _scheduler(role: str, policy: str = "fail") -> Scheduler:
    config = parse_kv_transfer_config({"kv_connector": "MooncakeConnectorV1", "kv_role": role,
                                       "engine_id": "e0", "kv_port": 30000,
                                       "kv_load_failure_policy": policy})
    return Scheduler(SchedulerConfig(8, 64, 256), CacheManager(32, BS, True), config)


def _consumer_request(num_tokens: int = 10, held_tokens: int = 10):
    params = parse_kv_transfer_params({
        "do_remote_prefill": True, "remote_engine_id": "e0", "remote_host": "127.0.0.1",
        "remote_port": 30000, "remote_block_ids": [5, 6, 7], "remote_request_id": "p-1",
        "remote_block_size": BS, "remote_num_tokens": held_tokens})
    return make_request(num_tokens, max_tokens=4, temperature=0.0, kv_transfer_params=params)


def test_consumer_pulls_then_computes_only_the_last_prompt_token():
    sched = _scheduler("kv_consumer")
    req = _consumer_request()
    sched.add_request(req)
    out = sched.schedule()
    assert not out.chunks and len(out.kv_pulls) == 1
    pull = out.kv_pulls[0]
    assert pull.remote.block_ids == [5, 6, 7] and len(pull.block_ids) == 3  # ceil(10 / 4)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and sched.has_unfinished_requests()
    sched.update(out, ModelOutput(kv_pulls_done={req.request_id: None}))
    out = sched.schedule()
    assert [c.token_ids for c in out.chunks] == [[9]] and out.chunks[0].start_pos == 9
    assert out.new_requests[0].block_ids == pull.block_ids
    updates = sched.update(out, ModelOutput(sampled={req.request_id: SampledToken(3)}))
    assert updates[0].new_token.token_id == 3 and req.num_computed_tokens == 10


def test_failed_pull_fails_the_request_and_frees_its_blocks():
    sched = _scheduler("kv_consumer")
    req = _consumer_request()
    sched.add_request(req)
    out = sched.schedule()
    assert sched.cache.usage() > 0
    sched.update(out, ModelOutput(kv_pulls_done={req.request_id: "no answer"}))
    assert sched.take_failures() == [(req.request_id, "KV transfer failed: no answer")]
    assert sched.cache.usage() == 0 and not sched.has_unfinished_requests()


def test_recompute_policy_prefills_locally_after_a_failed_pull():
    sched = _scheduler("kv_consumer", policy="recompute")
    req = _consumer_request()
    sched.add_request(req)
    sched.update(sched.schedule(), ModelOutput(kv_pulls_done={req.request_id: "gone"}))
    out = sched.schedule()
    assert not out.kv_pulls and out.chunks[0].token_ids == list(range(10))
    assert not sched.take_failures()


def test_aborted_pull_keeps_its_blocks_until_the_pull_ends():
    sched = _scheduler("kv_consumer")
    req = _consumer_request()
    sched.add_request(req)
    out = sched.schedule()
    sched.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    assert sched.cache.usage() > 0  # the workers may still be writing into them
    sched.update(sched.schedule(), ModelOutput(kv_pulls_done={req.request_id: None}))
    assert sched.cache.usage() == 0 and not sched.has_unfinished_requests()
    assert out.kv_pulls and not sched.take_failures()


def test_mismatched_producer_is_refused_by_name():
    sched = _scheduler("kv_consumer")
    req = _consumer_request(num_tokens=20, held_tokens=10)  # 10 tokens in 3 blocks
    sched.add_request(req)
    out = sched.schedule()
    assert not out.kv_pulls and "send the same prompt" in sched.take_failures()[0][1]


def test_producer_holds_blocks_until_pulled_or_timed_out():
    sched = _scheduler("kv_producer")
    params = parse_kv_transfer_params({"do_remote_decode": True})
    reqs = [make_request(10, max_tokens=1, temperature=0.0, kv_transfer_params=params)
            for _ in range(2)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()  # the step that ends them: the workers learn of the holds now
    assert [h.request_id for h in out.kv_holds] == [r.request_id for r in reqs]
    updates = sched.update(out, ModelOutput(sampled={r.request_id: SampledToken(1)
                                                     for r in reqs}))
    answer = updates[0].kv_transfer_params
    assert answer["remote_request_id"] == reqs[0].request_id and answer["remote_port"] == 30000
    assert answer["remote_num_tokens"] == 10 and len(answer["remote_block_ids"]) == 3
    assert sched.cache.usage() > 0 and not sched.has_unfinished_requests()
    out = sched.schedule()
    assert not out.kv_holds
    sched.update(out, ModelOutput(kv_sent=[reqs[0].request_id]))
    assert sched.remote.held.keys() == {reqs[1].request_id}
    sched.remote.held[reqs[1].request_id] = (reqs[1], 0.0)  # its deadline has passed
    out = sched.schedule()
    assert out.kv_releases == [reqs[1].request_id] and sched.cache.usage() == 0


def test_producer_request_aborted_after_its_hold_was_announced_is_released():
    sched = _scheduler("kv_producer")
    req = make_request(10, max_tokens=1, temperature=0.0,
                       kv_transfer_params=parse_kv_transfer_params({"do_remote_decode": True}))
    sched.add_request(req)
    assert sched.schedule().kv_holds
    sched.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().kv_releases == [req.request_id] and sched.cache.usage() == 0
