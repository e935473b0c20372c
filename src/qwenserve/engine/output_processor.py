"""OutputProcessor: turns per-step token updates into ``RequestOutput``s and statistics.

A request with ``n > 1`` runs as n child requests in the scheduler (``"{i}_{request_id}"``,
sharing the prompt's KV through the prefix cache); their completions are gathered here into one
``RequestOutput`` with n ``CompletionOutput``s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qwenserve.core.sched_output import RequestUpdate, SampledToken
from qwenserve.engine.detokenizer import IncrementalDetokenizer
from qwenserve.metrics.stats import FinishedRequestStats, IterationStats
from qwenserve.outputs import (
    CompletionOutput,
    Logprob,
    PooledData,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from qwenserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class _Completion:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    first_token_time: float | None = None  # monotonic
    last_token_time: float | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    arrival_wall: float
    arrival_mono: float
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # once the prompt has been scored
    prompt_logprobs_sent: bool = False
    pooled: PooledData | None = None  # pooling runner
    kv_transfer_params: dict | None = None  # P/D producer's answer, with its last output

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_mono: float) -> list[str]:
        """Register a request; returns the ids its n children run under."""
        children = child_request_ids(request_id, params.n)
        completions = []
        for i, child_id in enumerate(children):
            detok = (IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
                     if params.detokenize and self.tokenizer is not None else None)
            completions.append(_Completion(i, detok, logprobs=[] if params.logprobs is not None
                                           else None,
                                           cumulative_logprob=0.0 if params.logprobs is not None
                                           else None))
            self.child_to_parent[child_id] = (request_id, i)
        self.requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, completions,
            arrival_wall=time.time() - (time.monotonic() - arrival_mono),
            arrival_mono=arrival_mono)
        return children

    def process(self, updates: list[RequestUpdate], stats: IterationStats
                ) -> tuple[list[RequestOutput], dict[str, str]]:
        """Apply one step's updates. Returns the outputs to hand out and the children that a
        stop string finished (child id -> stop string), which the scheduler must now finish."""
        now = time.monotonic()
        touched: dict[str, set[int]] = {}
        stopped: dict[str, str] = {}
        for update in updates:
            child_id = update.request_id
            if child_id in stopped:  # speculative decoding: tokens after a stop string
                continue
            parent_id, index = self.child_to_parent[child_id]
            state = self.requests[parent_id]
            stop = self._apply(state, state.completions[index], update, now, stats)
            if stop is not None and not update.finished:
                stopped[child_id] = stop
            touched.setdefault(parent_id, set()).add(index)
        outputs = [out for parent_id, indices in touched.items()
                   if (out := self._make_output(parent_id, indices)) is not None]
        return outputs, stopped

    def _apply(self, state: _RequestState, comp: _Completion, update: RequestUpdate,
               now: float, stats: IterationStats) -> str | None:
        token = update.new_token
        if update.kv_transfer_params is not None:
            state.kv_transfer_params = update.kv_transfer_params
        if token is None:  # a pooling request: its prompt was all the work
            state.pooled = update.pooled
            state.num_cached_tokens = max(state.num_cached_tokens, update.num_cached_tokens)
            stats.num_prompt_tokens += len(state.prompt_token_ids)
            comp.first_token_time = comp.last_token_time = now
            comp.finish_reason = "stop"
            stats.finished.append(self._finished_stats(state, comp, update, now))
            return None
        comp.token_ids.append(token.token_id)
        stats.num_generation_tokens += 1
        if comp.first_token_time is None:
            comp.first_token_time = now
            state.num_cached_tokens = max(state.num_cached_tokens, update.num_cached_tokens)
            stats.num_prompt_tokens += len(state.prompt_token_ids)
            stats.ttfts_s.append(now - state.arrival_mono)
            if state.params.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = [None] + [
                    self._logprob_entry(comp, t) for t in update.prompt_logprobs or []]
        else:
            stats.itls_s.append(now - (comp.last_token_time or now))
        comp.last_token_time = now
        if comp.logprobs is not None and token.logprob is not None:
            self._add_logprobs(comp, token)
        stop = None
        stopped_by_token = update.finish_reason == "stop"
        if comp.detokenizer is not None and not (
                stopped_by_token and not state.params.include_stop_str_in_output):
            stop = comp.detokenizer.update([token.token_id])
        if stop is not None:
            comp.finish_reason, comp.stop_reason = "stop", stop
        elif update.finished:
            comp.finish_reason, comp.stop_reason = update.finish_reason, update.stop_reason
        if comp.finish_reason is not None:
            stats.finished.append(self._finished_stats(state, comp, update, now))
        return stop

    def _add_logprobs(self, comp: _Completion, token: SampledToken) -> None:
        comp.logprobs.append(self._logprob_entry(comp, token))
        comp.cumulative_logprob += token.logprob

    @staticmethod
    def _logprob_entry(comp: _Completion, token: SampledToken) -> dict[int, Logprob]:
        """The scored token first, then the top-k (vLLM's dict order and ranks)."""
        decode = comp.detokenizer.decode_token if comp.detokenizer else (lambda t: None)
        entry = {token.token_id: Logprob(token.logprob, token.rank, decode(token.token_id))}
        for rank, (tid, lp) in enumerate(token.top_logprobs or [], start=1):
            entry.setdefault(tid, Logprob(lp, rank, decode(tid)))
        return entry

    def _finished_stats(self, state: _RequestState, comp: _Completion, update: RequestUpdate,
                        now: float) -> FinishedRequestStats:
        wall_now = time.time()
        scheduled = update.first_scheduled_time or wall_now
        first = comp.first_token_time or now
        return FinishedRequestStats(
            finish_reason=comp.finish_reason or "abort",
            e2e_latency_s=now - state.arrival_mono,
            queue_time_s=max(0.0, scheduled - state.arrival_wall),
            prefill_time_s=max(0.0, first - state.arrival_mono
                               - max(0.0, scheduled - state.arrival_wall)),
            decode_time_s=now - first,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=len(comp.token_ids),
            max_tokens=state.params.max_tokens,
            n=state.params.n,
        )

    def _make_output(self, parent_id: str, indices: set[int]) -> RequestOutput | None:
        state = self.requests[parent_id]
        kind = state.params.output_kind
        finished = state.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        chosen = sorted(indices) if kind == RequestOutputKind.DELTA else range(
            len(state.completions))
        outputs = [self._completion_output(state.completions[i], kind) for i in chosen]
        if finished:
            self._forget(parent_id)
        prompt_logprobs = state.prompt_logprobs
        if kind == RequestOutputKind.DELTA:  # streamed: only with the first output, as vLLM
            prompt_logprobs = None if state.prompt_logprobs_sent else prompt_logprobs
            state.prompt_logprobs_sent |= prompt_logprobs is not None
        return RequestOutput(
            request_id=parent_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=outputs, finished=finished, prompt_logprobs=prompt_logprobs,
            pooled=state.pooled,
            kv_transfer_params=state.kv_transfer_params if finished else None,
            num_cached_tokens=state.num_cached_tokens,
            metrics=RequestMetrics(arrival_time=state.arrival_wall))

    @staticmethod
    def _completion_output(comp: _Completion, kind: RequestOutputKind) -> CompletionOutput:
        finished = comp.finish_reason is not None
        if kind == RequestOutputKind.DELTA:
            start = comp.num_sent_tokens
            comp.num_sent_tokens = len(comp.token_ids)
            text = comp.detokenizer.next_delta(finished) if comp.detokenizer else ""
            token_ids = comp.token_ids[start:]
            logprobs = comp.logprobs[start:] if comp.logprobs is not None else None
        else:
            text = comp.detokenizer.output_text if comp.detokenizer else ""
            token_ids, logprobs = list(comp.token_ids), comp.logprobs
        return CompletionOutput(comp.index, text, token_ids, comp.cumulative_logprob, logprobs,
                                comp.finish_reason, comp.stop_reason)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns the child ids to finish in the scheduler."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        children = child_request_ids(request_id, state.params.n)
        self._forget(request_id)
        return children

    def _forget(self, parent_id: str) -> None:
        state = self.requests.pop(parent_id)
        for child_id in child_request_ids(parent_id, state.params.n):
            self.child_to_parent.pop(child_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests
