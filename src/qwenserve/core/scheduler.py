"""Continuous-batching scheduler (pure Python, no torch).

Every step packs work under ONE token budget (``max_num_batched_tokens``) and ``max_num_seqs``:
running requests first (a decode takes 1 token, an unfinished prefill takes its next chunk), then
waiting requests in arrival order (FCFS; a long prompt is prefilled over several steps). When the
cache runs out of blocks, the most recently admitted running request is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later. Nothing is lost: its
output tokens are kept and recomputed as part of its prompt.
"""

from __future__ import annotations

import time
from collections import deque

from qwenserve.config import SchedulerConfig
from qwenserve.core.cache.manager import CacheManager
from qwenserve.core.sched_output import (
    ModelOutput,
    NewRequestData,
    RequestUpdate,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
)
from qwenserve.metrics.stats import SchedulerStats
from qwenserve.request import Request, RequestStatus


class Scheduler:
    def __init__(self, limits: SchedulerConfig, cache: CacheManager) -> None:
        self.limits = limits
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # workers drop their state for these next step
        self.num_preemptions = 0

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
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.stop_reason = stop_reason
            self._finish(req, status)
            finished.append(req)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self._schedule_running(out, self.limits.max_num_batched_tokens)
        if not out.preempted_request_ids:
            self._schedule_waiting(out, budget)
        self._save_states(out)
        now = time.time()
        for chunk in out.chunks:
            req = self.requests[chunk.request_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk_len(req, req.num_computed_tokens,
                                      min(req.num_tokens - req.num_computed_tokens, budget))
            new_blocks = self.cache.allocate(req, num_new)
            while new_blocks is None:
                victim = self.running.pop()  # the most recently admitted, never one scheduled
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is req:
                    return budget
                new_blocks = self.cache.allocate(req, num_new)
            out.chunks.append(self._chunk(req, num_new, new_blocks))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            req = self.waiting[0]
            # Prompt logprobs need every prompt position computed: no prefix-cache hit (vLLM's
            # rule too). The blocks it computes are still cached for others.
            hit_blocks = ([] if req.sampling_params.prompt_logprobs is not None
                          else self.cache.lookup_prefix(req))
            num_hit = len(hit_blocks) * self.cache.block_size
            checkpoint = self.cache.checkpoint_slot(req, len(hit_blocks))
            num_new = self._chunk_len(req, num_hit, min(req.num_tokens - num_hit, budget))
            if self.cache.allocate(req, num_new, hit_blocks, keep_slot=checkpoint) is None:
                break  # FCFS: later requests wait behind this one
            if checkpoint is not None:
                out.state_restores.append(self.cache.restore_state(req, checkpoint))
            self.waiting.popleft()
            self.cache.record_prefix_query(req.num_tokens, num_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.new_requests.append(NewRequestData(
                request_id=req.request_id,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=list(req.output_token_ids),
                sampling_params=req.sampling_params,
                block_ids=list(self.cache.block_ids(req.request_id)),
                state_slot=self.cache.state_slot(req.request_id),
            ))
            out.chunks.append(self._chunk(req, num_new, []))
            budget -= num_new

    def _chunk_len(self, req: Request, start: int, num_new: int) -> int:
        """Hybrid models with prefix caching stop a prefill once at the request's checkpoint
        position, so that its recurrent state can be saved there (``_save_states``)."""
        position = self.cache.checkpoint_position(req) if num_new > 1 else None
        if position is not None and start < position < start + num_new:
            return position - start
        return num_new

    def _save_states(self, out: SchedulerOutput) -> None:
        """State checkpoints at the block boundaries where this step's prefill chunks end
        (after every allocation of the step: no request of it may be handed a checkpoint's
        slot). The workers copy them after the forward pass."""
        taken: set[int] = set()
        for chunk in out.chunks:
            if len(chunk.token_ids) > 1:
                end = chunk.start_pos + len(chunk.token_ids)
                copy = self.cache.save_state(self.requests[chunk.request_id], end, taken)
                if copy is not None:
                    out.state_saves.append(copy)
                    taken.add(copy[1])

    def _chunk(self, req: Request, num_new: int, new_blocks: list[int]) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.token_ids_slice(start, start + num_new),
            start_pos=start,
            new_block_ids=new_blocks,
            sample=start + num_new == req.num_tokens,
        )

    def _preempt(self, req: Request) -> None:
        self.cache.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the forward pass ---------------------------------------------------------------
    def update(self, sched_out: SchedulerOutput, model_out: ModelOutput) -> list[RequestUpdate]:
        updates = []
        for chunk in sched_out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or preempted since it was scheduled
            req.num_computed_tokens += len(chunk.token_ids)
            self.cache.cache_full_blocks(req)
            if req.request_id in model_out.prompt_logprobs:
                _collect_prompt_logprobs(req, *model_out.prompt_logprobs[req.request_id])
            if not chunk.sample:
                continue
            token = model_out.sampled[req.request_id]
            req.output_token_ids.append(token.token_id)
            status = self._stop_status(req, token.token_id)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
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

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.cache.free(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    # ---- observation --------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.cache.usage(),
            prefix_cache_queries=self.cache.stats.queries,
            prefix_cache_hits=self.cache.stats.hits,
            num_preemptions=self.num_preemptions,
        )


def _update(req: Request, token: SampledToken) -> RequestUpdate:
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
    )


def _collect_prompt_logprobs(req: Request, first_pos: int, entries: list[SampledToken]) -> None:
    """Append the entries not collected yet: a request recomputed after preemption scores its
    prompt again, and those duplicates are dropped."""
    have = len(req.prompt_logprobs)
    if first_pos <= have:
        req.prompt_logprobs.extend(entries[have - first_pos:])
