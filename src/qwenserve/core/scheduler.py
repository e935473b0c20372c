"""Continuous-batching scheduler (pure Python, no torch).

Every step packs work under ONE token budget (``max_num_batched_tokens``) and ``max_num_seqs``:
running requests first (a decode takes 1 token, an unfinished prefill takes its next chunk), then
waiting requests in arrival order (FCFS; a long prompt is prefilled over several steps). When the
cache runs out of blocks, the most recently admitted running request is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later. Nothing is lost: its
output tokens are kept and recomputed as part of its prompt.

Speculative decoding: a decode whose request has draft tokens (proposed by the workers after the
previous step) takes 1 + k tokens of the budget; the workers verify them in the same forward
pass and ``update`` keeps the KV of the accepted ones only (``num_computed_tokens`` stops after
them; the blocks stay with the request and are overwritten by the next tokens).

Prefill/decode disaggregation (``remote_kv.py``): a consumer's request waits, out of both
queues, while its prompt's KV is pulled, then is admitted with all but its last prompt token
computed; a producer's finished request keeps its blocks until a consumer has pulled them.
"""

from __future__ import annotations

import time
from collections import deque

from qwenserve.config import SchedulerConfig
from qwenserve.core.cache.manager import NO_HIT, Allocation, CacheManager
from qwenserve.core.encoder_budget import EncoderBudget, fit_chunk
from qwenserve.core.remote_kv import RemoteKV
from qwenserve.core.sched_output import (
    ModelOutput,
    NewRequestData,
    RequestUpdate,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
)
from qwenserve.kv_transfer.config import KVTransferConfig
from qwenserve.metrics.stats import SchedulerStats, SpecDecodingStats
from qwenserve.outputs import PooledData
from qwenserve.request import Request, RequestStatus


class Scheduler:
    def __init__(self, limits: SchedulerConfig, cache: CacheManager,
                 kv_transfer: KVTransferConfig | None = None, tp_size: int = 1) -> None:
        self.limits = limits
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # workers drop their state for these next step
        self.num_preemptions = 0
        self._spec_stats = SpecDecodingStats()  # since the last take_spec_stats()
        self.spec_totals = SpecDecodingStats()  # since start
        self._encoder_budget = EncoderBudget(limits.max_num_batched_tokens)
        self.remote = RemoteKV(kv_transfer, cache.block_size, tp_size)
        self._failures: list[tuple[str, str]] = []  # (request id, why): failed after admission

    # ---- requests in and out ------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_requests(self, request_ids: list[str], status: RequestStatus,
                        stop_reason: int | str | None = None) -> list[Request]:
        """Finish (e.g. abort, or a stop string found) requests wherever they are."""
        finished = []
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None or req.is_finished:
                continue
            req.stop_reason = stop_reason
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # The workers may still be writing its blocks: freed when the pull ends.
                self.remote.aborted_pulls.add(request_id)
                self._finish(req, status, free=False)
                finished.append(req)
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            finished.append(req)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.remote.pulling)

    def take_failures(self) -> list[tuple[str, str]]:
        """Requests that failed after admission (a KV pull), with why, since the last call."""
        failures, self._failures = self._failures, []
        return failures

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        self._encoder_budget = EncoderBudget(self.limits.max_num_batched_tokens)
        for req in self.remote.take_expired():
            self._release_hold(req)
        budget = self._schedule_running(out, self.limits.max_num_batched_tokens)
        if not out.preempted_request_ids:
            self._schedule_waiting(out, budget)
        self.remote.fill(out)
        now = time.time()
        for chunk in out.chunks:
            req = self.requests[chunk.request_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            planned = self.cache.planned_checkpoint(chunk.request_id)
            if planned is not None:  # asked last: a later admission may have taken its slot
                chunk.state_checkpoint = (planned.position - chunk.start_pos, planned.slot)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._fit_encoder(req, req.num_computed_tokens,
                                        min(req.num_tokens - req.num_computed_tokens, budget),
                                        first_chunk=False)
            if num_new == 0:  # its next image waits for a step with encoder budget left
                i += 1
                continue
            num_new = self.remote.prefill_limit(req, req.num_computed_tokens, num_new,
                                                self.cache.has_states)
            drafts = self._drafts(req, num_new, budget)
            num_new += len(drafts)
            alloc = self.cache.allocate(req, num_new)
            while alloc is None:
                victim = self.running.pop()  # the most recently admitted, never one scheduled
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is req:
                    return budget
                alloc = self.cache.allocate(req, num_new)
            self._add_chunk(out, req, alloc, drafts=drafts)
            budget -= alloc.num_tokens
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while (self.waiting and budget > 0
               and len(self.running) + len(self.remote.pulling) < self.limits.max_num_seqs):
            req = self.waiting[0]
            if req.needs_kv_pull:
                if not self._start_pull(req):
                    break
                continue
            if req.kv_loaded:  # its prompt's KV arrived: compute the last prompt token
                alloc = self.cache.allocate(req, 1)
                if alloc is None:
                    break
                self.waiting.popleft()
                req.kv_loaded = False
                self._admit(out, req, alloc, list(self.cache.block_ids(req.request_id)))
                budget -= alloc.num_tokens
                continue
            # Prompt logprobs need every prompt position computed: no prefix-cache hit (vLLM's
            # rule too). The blocks it computes are still cached for others.
            hit = (NO_HIT if req.sampling_params.prompt_logprobs is not None
                   else self.cache.lookup_prefix(req))
            num_new = self._fit_encoder(req, hit.num_tokens,
                                        min(req.num_tokens - hit.num_tokens, budget),
                                        first_chunk=True)
            num_new = self.remote.prefill_limit(req, hit.num_tokens, num_new,
                                                self.cache.has_states)
            alloc = self.cache.allocate(req, num_new, hit) if num_new else None
            if alloc is None:
                break  # FCFS: later requests wait behind this one
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit.num_tokens
            req.num_computed_tokens = hit.num_tokens
            self._admit(out, req, alloc, list(alloc.new_block_ids))
            budget -= alloc.num_tokens

    def _admit(self, out: SchedulerOutput, req: Request, alloc: Allocation,
               block_ids: list[int]) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.new_requests.append(NewRequestData(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
            sampling_params=req.sampling_params,
            block_ids=block_ids,
            state_slot=alloc.state_slot,
            mm_inputs=req.mm_inputs,
        ))
        self._add_chunk(out, req, alloc, new_request=True)

    def _start_pull(self, req: Request) -> bool:
        """P/D consumer: blocks for the whole prompt, then the workers pull its KV into them.
        False when the cache has no room (FCFS: later requests wait behind it)."""
        problem = self.remote.pull_problem(req, self.cache.has_states)
        if problem is not None:
            self.waiting.popleft()
            self._fail(req, problem)
            return True
        alloc = self.cache.allocate(req, req.num_prompt_tokens, exact=True)
        if alloc is None:
            return False
        self.waiting.popleft()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.first_scheduled_time = req.first_scheduled_time or time.time()
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = 0
        self.remote.start_pull(req, alloc.new_block_ids, alloc.state_slot)
        return True

    def _pull_ended(self, request_id: str, error: str | None) -> None:
        req = self.remote.pulling.pop(request_id, None)
        if req is None:
            return
        if request_id in self.remote.aborted_pulls:  # already finished: free its blocks now
            self.remote.aborted_pulls.discard(request_id)
            self.cache.free(req)
            return
        if error is None:  # the prompt's KV is here; its last token is recomputed for logits
            req.num_computed_tokens = req.num_prompt_tokens - 1
            req.kv_loaded = True
            self.cache.cache_full_blocks(req)
        elif self.remote.config is not None and self.remote.config.failure_policy == "recompute":
            self.cache.free(req)  # prefill it here instead
        else:
            req.status = RequestStatus.WAITING  # _fail frees it as a waiting request
            self._fail(req, f"KV transfer failed: {error}")
            return
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _fail(self, req: Request, why: str) -> None:
        self._failures.append((req.request_id, why))
        self._finish(req, RequestStatus.FINISHED_ABORTED)

    def _fit_encoder(self, req: Request, start: int, num_new: int, first_chunk: bool) -> int:
        """Cut the chunk before an image the step's encoder budget cannot take (text: as is).
        The cache may shorten the chunk further; the images it then misses were charged all
        the same (the budget errs on the safe side)."""
        if req.mm_inputs is None or start >= req.num_prompt_tokens:
            return num_new
        return fit_chunk(req.mm_inputs.placements, start, num_new, first_chunk,
                         self._encoder_budget)

    def _add_chunk(self, out: SchedulerOutput, req: Request, alloc: Allocation,
                   new_request: bool = False, drafts: list[int] | None = None) -> None:
        """The request's chunk, and the state copies its allocation asks the workers for."""
        out.state_saves += alloc.state_saves
        out.state_restores += alloc.state_restores
        drafts = drafts or []
        # A new request's blocks travel in its NewRequestData; a running one's as an increment.
        chunk = self._chunk(req, alloc.num_tokens, [] if new_request else alloc.new_block_ids,
                            drafts)
        out.chunks.append(chunk)
        if (chunk.sample and req.max_tokens - req.num_output_tokens <= 1
                and self.remote.wants_hold(req)):  # this step ends it: its blocks are held
            state_slot = None
            if self.cache.has_states and req.num_output_tokens == 0:
                # The state before the last prompt token, copied before this step runs.
                state_slot = self.cache.hold_state(req.request_id)
                if state_slot is not None:
                    out.state_saves.append((alloc.state_slot, state_slot))
            self.remote.register(req, self.cache.block_ids(req.request_id), state_slot)

    def _drafts(self, req: Request, num_new: int, budget: int) -> list[int]:
        """The request's draft tokens to verify in this step's decode: at most what the budget,
        ``max_tokens`` (k drafts may emit k + 1 tokens) and ``max_model_len`` leave room for."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        limit = self.limits.spec_disable_by_batch_size
        if (not drafts or num_new != 1 or req.num_tokens - req.num_computed_tokens != 1
                or (limit is not None and len(self.running) >= limit)):
            return []
        room = min(self.limits.num_speculative_tokens, budget - 1,
                   req.max_tokens - req.num_output_tokens - 1,
                   self.limits.max_model_len - req.num_tokens)
        return drafts[: max(room, 0)]

    def _chunk(self, req: Request, num_new: int, new_blocks: list[int],
               drafts: list[int]) -> ScheduledChunk:
        start = req.num_computed_tokens
        num_known = num_new - len(drafts)
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.token_ids_slice(start, start + num_known) + drafts,
            start_pos=start,
            new_block_ids=new_blocks,
            sample=start + num_known == req.num_tokens,
            num_draft_tokens=len(drafts),
        )

    def _preempt(self, req: Request) -> None:
        self.cache.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the forward pass ---------------------------------------------------------------
    def update(self, sched_out: SchedulerOutput, model_out: ModelOutput) -> list[RequestUpdate]:
        for req in self.remote.take_sent(model_out.kv_sent):
            self._release_hold(req)
        for request_id, error in model_out.kv_pulls_done.items():
            self._pull_ended(request_id, error)
        updates = []
        for chunk in sched_out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or preempted since it was scheduled
            req.num_computed_tokens += len(chunk.token_ids) - chunk.num_draft_tokens
            if req.request_id in model_out.prompt_logprobs:
                _collect_prompt_logprobs(req, *model_out.prompt_logprobs[req.request_id])
            if not chunk.sample:
                self.cache.cache_full_blocks(req)
                continue
            if req.request_id in model_out.pooled:  # prefill-only: the prompt was the work
                self.cache.cache_full_blocks(req)
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                updates.append(_update(req, None, model_out.pooled[req.request_id]))
                continue
            tokens = (model_out.accepted.get(req.request_id, [])
                      + [model_out.sampled[req.request_id]])
            if chunk.num_draft_tokens:
                self._spec_stats.observe(chunk.num_draft_tokens, len(tokens) - 1)
                self.spec_totals.observe(chunk.num_draft_tokens, len(tokens) - 1)
            updates += self._append_tokens(req, tokens, model_out)
        return updates

    def _append_tokens(self, req: Request, tokens: list[SampledToken],
                       model_out: ModelOutput) -> list[RequestUpdate]:
        """Append the step's tokens (several with accepted drafts) one at a time: a stop token
        or ``max_tokens`` ends them early and the rest are dropped."""
        updates = []
        status = None
        for i, token in enumerate(tokens):
            req.output_token_ids.append(token.token_id)
            status = self._stop_status(req, token.token_id)
            if status is not None or i == len(tokens) - 1:
                break
            updates.append(_update(req, token))
        # The KV holds every token but the last one emitted: the accepted drafts included.
        req.num_computed_tokens = req.num_tokens - 1
        if i == len(tokens) - 1:  # cut short, the recurrent state would not match: skip
            self.cache.cache_full_blocks(req)
        if status is not None:
            self.running.remove(req)
            self._finish(req, status, hold=True)
        else:
            req.spec_token_ids = model_out.draft_token_ids.get(req.request_id, [])
        updates.append(_update(req, token))
        return updates

    def _stop_status(self, req: Request, token_id: int) -> RequestStatus | None:
        params = req.sampling_params
        if token_id in params.all_stop_token_ids and req.num_output_tokens > params.min_tokens - 1:
            if token_id in params.stop_token_ids:
                req.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.limits.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, req: Request, status: RequestStatus, hold: bool = False,
                free: bool = True) -> None:
        """``hold``: a P/D producer's request keeps its blocks for the consumer to pull."""
        req.status = status
        if hold and self.remote.wants_hold(req):
            self.remote.hold(req, self.cache.block_ids(req.request_id))
        elif free:
            self.remote.unregister(req.request_id)
            self._release_hold(req)
        del self.requests[req.request_id]

    def _release_hold(self, req: Request) -> None:
        """Free a request's blocks and slot (and a P/D producer's held state copy)."""
        self.cache.free(req)
        if self.remote.state_slots.pop(req.request_id, None) is not None:
            self.cache.release_held_state(req.request_id)
        self._finished_ids.append(req.request_id)

    # ---- observation --------------------------------------------------------------------------
    def take_spec_stats(self) -> SpecDecodingStats | None:
        """Speculative-decoding counters since the last call (None: not speculating)."""
        if not self.limits.num_speculative_tokens:
            return None
        spec, self._spec_stats = self._spec_stats, SpecDecodingStats()
        return spec

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            # a P/D consumer's request waiting for its KV counts as waiting, as in vLLM
            num_waiting=len(self.waiting) + len(self.remote.pulling)
            - len(self.remote.aborted_pulls),
            kv_cache_usage=self.cache.usage(),
            prefix_cache_queries=self.cache.stats.queries,
            prefix_cache_hits=self.cache.stats.hits,
            num_preemptions=self.num_preemptions,
        )


def _update(req: Request, token: SampledToken | None,
            pooled: PooledData | None = None) -> RequestUpdate:
    """The step's news about ``req`` as plain data (the live request stays in core)."""
    finish = req.finish_reason
    first = req.num_output_tokens == 1
    return RequestUpdate(
        request_id=req.request_id,
        new_token=token,
        finish_reason=None if finish is None else finish.value,
        stop_reason=req.stop_reason,
        num_cached_tokens=req.num_cached_tokens,
        first_scheduled_time=req.first_scheduled_time,
        prompt_logprobs=list(req.prompt_logprobs)
        if first and req.sampling_params.prompt_logprobs is not None else None,
        pooled=pooled,
        kv_transfer_params=req.kv_transfer_out,
    )


def _collect_prompt_logprobs(req: Request, first_pos: int, entries: list[SampledToken]) -> None:
    """Append the entries not collected yet: a request recomputed after preemption scores its
    prompt again, and those duplicates are dropped."""
    have = len(req.prompt_logprobs)
    if first_pos <= have:
        req.prompt_logprobs.extend(entries[have - first_pos:])
