"""Streaming ``/v1/chat/completions``: SSE chunks with vLLM's order and fields.

role chunk (after the first engine output) -> delta chunks (content, reasoning, tool_calls)
-> last chunk with finish_reason -> usage chunk (stream_options.include_usage) -> [DONE]
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from qwenserve.entrypoints.openai.serving_chat import ChatJob, ChoiceParser, log_chat
from qwenserve.entrypoints.openai.serving_common import (
    ServerState,
    chat_logprobs,
    engine_error,
    prompt_logprobs_body,
    usage,
)
from qwenserve.entrypoints.openai.streaming import DONE, ChunkEncoder, chain_first, sse
from qwenserve.outputs import CompletionOutput, RequestOutput


class _StreamChoice:
    """One choice of a stream: its parser, token count, and logprobs not yet sent."""

    def __init__(self, state: ServerState, job: ChatJob) -> None:
        self.parser = ChoiceParser(state, job)
        self.num_tokens = 0
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[dict] = []


async def stream_chat(
    state: ServerState,
    job: ChatJob,
    first: RequestOutput | None,
    agen: AsyncIterator[RequestOutput],
) -> AsyncIterator[str]:
    """SSE chunks. The role chunk goes out only with the first engine output (after prefill),
    so clients that take the first chunk as the first token measure TTFT correctly."""
    req = job.request
    opts = req.stream_options
    include_usage = state.options.enable_force_include_usage or bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    choices = [_StreamChoice(state, job) for _ in range(req.n)]
    finishes: list[str] = []
    num_cached = 0
    encoder = ChunkEncoder(_head(job))
    try:
        if first is not None:
            yield _role_chunks(state, job, include_usage, first)
        async for out in chain_first(first, agen):
            num_cached = max(num_cached, out.num_cached_tokens)
            for comp in out.outputs:
                body = _delta_choice(state, job, choices[comp.index], comp, finishes)
                if body is None:
                    continue
                fields: dict[str, Any] = {"choices": [body]}
                if include_usage:
                    fields["usage"] = (
                        _stream_usage(state, job, choices, num_cached) if continuous else None
                    )
                yield encoder.encode(fields)
        usage_body = _stream_usage(state, job, choices, num_cached)
        if include_usage:
            yield sse({**_chunk(job, []), "usage": usage_body})
        log_chat(state, job, usage_body, ",".join(finishes))
    except (GeneratorExit, asyncio.CancelledError):
        log_chat(state, job, None, state.abort_reason())
        raise
    except Exception as e:
        yield sse(engine_error(e).body())
    finally:
        await agen.aclose()  # type: ignore[attr-defined]
    yield DONE


def _role_chunks(
    state: ServerState, job: ChatJob, include_usage: bool, first: RequestOutput
) -> str:
    """The role chunk (every choice), carrying ``prompt_logprobs`` when they were asked for."""
    role = state.options.response_role
    chunk = _chunk(
        job,
        [
            {
                "index": i,
                "delta": {"role": role, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(job.request.n)
        ],
    )
    if first.prompt_logprobs is not None:
        chunk["prompt_logprobs"] = prompt_logprobs_body(first.prompt_logprobs)
    if include_usage:
        chunk["usage"] = None
    return sse(chunk)


def _delta_choice(
    state: ServerState,
    job: ChatJob,
    choice: _StreamChoice,
    comp: CompletionOutput,
    finishes: list[str],
) -> dict[str, Any] | None:
    """The chunk's choice for one completion's new output, or None while parsers hold text
    back."""
    choice.num_tokens += len(comp.token_ids)
    if comp.logprobs is not None:
        choice.pending_ids += comp.token_ids
        choice.pending_logprobs += comp.logprobs
    final = comp.finish_reason is not None
    delta = choice.parser.feed(comp.text, final)
    if not delta and not final:
        return None
    body: dict[str, Any] = {
        "index": comp.index,
        "delta": delta or {"content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    if comp.logprobs is not None:
        body["logprobs"] = chat_logprobs(
            state, choice.pending_ids, choice.pending_logprobs, job.request.top_logprobs or 0
        )
        choice.pending_ids, choice.pending_logprobs = [], []
    if final:
        body["finish_reason"] = choice.parser.finish_reason(comp.finish_reason)
        body["stop_reason"] = comp.stop_reason
        finishes.append(body["finish_reason"])
    return body


def _head(job: ChatJob) -> dict[str, Any]:
    """The fields every chunk of the stream repeats."""
    return {
        "id": job.public_id,
        "object": "chat.completion.chunk",
        "created": job.created,
        "model": job.model,
    }


def _chunk(job: ChatJob, choices: list[dict]) -> dict[str, Any]:
    return {**_head(job), "choices": choices}


def _stream_usage(
    state: ServerState, job: ChatJob, choices: list[_StreamChoice], num_cached: int
) -> dict[str, Any]:
    return usage(state, len(job.prompt_ids), sum(c.num_tokens for c in choices), num_cached)
