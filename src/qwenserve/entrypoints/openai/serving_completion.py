"""``POST /v1/completions``: one or several prompts (text or token ids), streamed or not.

Choice ``index`` is ``prompt_index * n + completion_index``, as in vLLM, so a batch of prompts
with ``n > 1`` keeps every completion apart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from qwenserve.entrypoints.openai.errors import bad_request
from qwenserve.entrypoints.openai.protocol import CompletionRequest
from qwenserve.entrypoints.openai.serving_common import (
    ServerState,
    build_sampling_params,
    completion_logprobs,
    engine_error,
    log_request,
    prompt_logprobs_body,
    resolve_max_tokens,
    truncate_prompt,
    usage,
)
from qwenserve.entrypoints.openai.streaming import (
    DONE,
    ChunkEncoder,
    chain_first,
    merge_async_iterators,
    sse,
)
from qwenserve.entrypoints.openai.structured import apply_constraints
from qwenserve.outputs import RequestOutput
from qwenserve.sampling_params import SamplingParams


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams


@dataclass
class CompletionJob:
    """A validated request, ready to run: everything a 400 could come from is checked."""

    request: CompletionRequest
    public_id: str
    engine_id: str
    model: str
    prompts: list[_Prompt]
    created: int
    start_s: float
    constraint_source: str | None = None  # the field that constrains the output, if any

    @property
    def n(self) -> int:
        return self.request.n


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def prepare_completion(
    state: ServerState, req: CompletionRequest, request_id: str | None
) -> CompletionJob:
    model = state.check_model(req.model)
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported by qwenserve yet", "best_of")
    prompts = []
    source = None
    if req.kv_transfer_params is not None and len(_prompt_list(req.prompt)) > 1:
        raise bad_request("kv_transfer_params with several prompts is not implemented; send "
                          "one prompt per request", "kv_transfer_params")
    for item in _prompt_list(req.prompt):
        if isinstance(item, str):
            state.check_prompt_chars(item)
            ids = state.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
            text = item
        else:
            ids, text = list(item), None
            state.check_prompt_ids(ids)
        ids = truncate_prompt(req, state, ids)
        if not ids:
            raise bad_request("The prompt is empty; give at least one token", "prompt")
        max_tokens = resolve_max_tokens(state, req.max_tokens, len(ids))
        params = build_sampling_params(state, req, max_tokens, req.logprobs, bool(req.stream))
        prompt_text = text if text is not None else state.tokenizer.decode(ids)
        source = apply_constraints(state, req, params, prompt_text)
        prompts.append(_Prompt(text, ids, params))
    public_id, engine_id = state.request_ids("cmpl", req.request_id or request_id)
    return CompletionJob(
        req, public_id, engine_id, model, prompts, int(time.time()), time.monotonic(), source
    )


def _generators(state: ServerState, job: CompletionJob) -> list[AsyncIterator[RequestOutput]]:
    state.admission.check(len(job.prompts) * job.n)
    return [
        state.admission.admit(
            state.engine.generate(p.token_ids, p.params, f"{job.engine_id}-{i}", prompt=p.text),
            job.n,
        )
        for i, p in enumerate(job.prompts)
    ]


def _echo_text(state: ServerState, prompt: _Prompt) -> str:
    return prompt.text if prompt.text is not None else state.tokenizer.decode(prompt.token_ids)


@dataclass
class _Echo:
    """What an echoed prompt adds in front of a choice: its text and, with ``logprobs``, its
    tokens and their scores (vLLM prepends those to the completion's own)."""

    text: str = ""
    token_ids: list[int] | None = None
    logprobs: list | None = None


def _echo(state: ServerState, job: CompletionJob, i: int, prompt_lps: Any) -> _Echo:
    if not job.request.echo:
        return _Echo()
    prompt = job.prompts[i]
    if job.request.logprobs is None or prompt_lps is None:
        return _Echo(_echo_text(state, prompt))
    return _Echo(_echo_text(state, prompt), prompt.token_ids, list(prompt_lps))


def _choice(
    state: ServerState, job: CompletionJob, index: int, comp: Any, echo: _Echo, offset: int
) -> dict[str, Any]:
    """One choice; ``offset`` is where its text (echoed prompt included) starts."""
    ids, entries = comp.token_ids, comp.logprobs
    if echo.logprobs is not None and entries is not None:
        ids, entries = [*echo.token_ids, *ids], [*echo.logprobs, *entries]
    else:
        offset += len(echo.text)
    return {
        "index": index,
        "text": echo.text + comp.text,
        "logprobs": completion_logprobs(state, ids, entries, job.request.logprobs or 0, offset),
        "finish_reason": comp.finish_reason,
        "stop_reason": comp.stop_reason,
    }


async def complete(state: ServerState, job: CompletionJob) -> dict[str, Any]:
    """The non-streaming response."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in merge_async_iterators(*_generators(state, job)):
            finals[i] = out
    except asyncio.CancelledError:
        _log(state, job, None, state.abort_reason())
        raise
    except Exception as e:
        _log(state, job, None, "error")
        raise engine_error(e) from e
    choices, num_output = [], 0
    for i, out in sorted(finals.items()):
        echo = _echo(state, job, i, out.prompt_logprobs)
        scored = prompt_logprobs_body(out.prompt_logprobs)
        for comp in out.outputs:
            num_output += len(comp.token_ids)
            choice = _choice(state, job, i * job.n + comp.index, comp, echo, 0)
            choices.append({**choice, "prompt_logprobs": scored})
    choices.sort(key=lambda c: c["index"])
    num_prompt = sum(len(p.token_ids) for p in job.prompts)
    num_cached = sum(out.num_cached_tokens for out in finals.values())
    usage_body = usage(state, num_prompt, num_output, num_cached)
    _log(state, job, usage_body, ",".join(str(c["finish_reason"]) for c in choices))
    return {
        **_chunk(job, choices),
        "usage": usage_body,
        "system_fingerprint": None,
        "kv_transfer_params": finals[0].kv_transfer_params if finals else None,
    }


def _log(state: ServerState, job: CompletionJob, usage_body: Any, finish: str) -> None:
    log_request(
        state,
        job.public_id,
        "/v1/completions",
        job.request.prompt,
        usage_body,
        finish,
        job.start_s,
    )


class _StreamState:
    """Per-stream counters: tokens per prompt, text offsets per choice, finish reasons."""

    def __init__(self, state: ServerState, job: CompletionJob) -> None:
        self.state, self.job = state, job
        opts = job.request.stream_options
        self.include_usage = state.options.enable_force_include_usage or bool(
            opts and opts.include_usage
        )
        self.continuous = self.include_usage and bool(opts and opts.continuous_usage_stats)
        self.num_output = [0] * len(job.prompts)
        self.num_cached = [0] * len(job.prompts)
        self.offsets: dict[int, int] = {}
        self.finishes: list[str] = []
        # Prompt logprobs come with a prompt's first output only; n choices each echo them.
        self.prompt_lps: dict[int, Any] = {}
        self.encoder = ChunkEncoder(_head(job))

    def chunk(self, i: int, out: RequestOutput, comp: Any) -> str:
        index = i * self.job.n + comp.index
        first = index not in self.offsets
        new_scores = out.prompt_logprobs is not None and i not in self.prompt_lps
        if new_scores:
            self.prompt_lps[i] = out.prompt_logprobs
        echo = _echo(self.state, self.job, i, self.prompt_lps.get(i)) if first else _Echo()
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(echo.text) + len(comp.text)
        self.num_output[i] += len(comp.token_ids)
        self.num_cached[i] = max(self.num_cached[i], out.num_cached_tokens)
        if comp.finish_reason is not None:
            self.finishes.append(comp.finish_reason)
        choice = _choice(self.state, self.job, index, comp, echo, offset)
        if new_scores:
            choice["prompt_logprobs"] = prompt_logprobs_body(out.prompt_logprobs)
        fields: dict[str, Any] = {"choices": [choice]}
        if self.include_usage:
            fields["usage"] = self.usage() if self.continuous else None
        return self.encoder.encode(fields)

    def usage(self) -> dict[str, Any]:
        num_prompt = sum(len(p.token_ids) for p in self.job.prompts)
        return usage(self.state, num_prompt, sum(self.num_output), sum(self.num_cached))


async def stream_completion(
    state: ServerState,
    job: CompletionJob,
    first: tuple[int, RequestOutput] | None,
    merged: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[str]:
    """SSE chunks; ``first`` is the output already pulled to surface errors as plain 400s."""
    stream = _StreamState(state, job)
    try:
        async for i, out in chain_first(first, merged):
            for comp in out.outputs:
                yield stream.chunk(i, out, comp)
        usage_body = stream.usage()
        if stream.include_usage:
            yield sse({**_chunk(job, []), "usage": usage_body})
        _log(state, job, usage_body, ",".join(stream.finishes))
    except (GeneratorExit, asyncio.CancelledError):
        _log(state, job, None, state.abort_reason())
        raise
    except Exception as e:
        yield sse(engine_error(e).body())
    finally:
        await merged.aclose()  # type: ignore[attr-defined]
    yield DONE


def _head(job: CompletionJob) -> dict[str, Any]:
    """The fields every chunk of the stream repeats."""
    return {
        "id": job.public_id,
        "object": "text_completion",
        "created": job.created,
        "model": job.model,
    }


def _chunk(job: CompletionJob, choices: list[dict]) -> dict[str, Any]:
    return {**_head(job), "choices": choices}


def start_stream(
    state: ServerState, job: CompletionJob
) -> AsyncIterator[tuple[int, RequestOutput]]:
    return merge_async_iterators(*_generators(state, job))
