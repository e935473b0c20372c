"""One streamed request against an OpenAI-compatible server, timed the way vLLM times it.

The request bodies and the timing rules are vLLM's
(``vllm/benchmarks/lib/endpoint_request_func.py``):
the clock starts just before the POST; TTFT is the first ``data:`` chunk with a non-empty
``choices`` list; every later such chunk adds one ITL sample; E2EL ends at the last chunk with
choices (the trailing usage chunk carries no token, for completions and chat alike). The usage
chunk's ``completion_tokens`` and ``prompt_tokens`` replace the client's counts, so input and
output totals are the server's own. Two deliberate differences, both about failures only: a
non-200 answer records its status and message rather than the bare reason phrase, and an
``{"error": ...}`` event in the stream fails the request instead of passing silently.
"""

from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from qwenserve.tools.bench.errors import first_line
from qwenserve.tools.bench.metrics import RequestResult

BACKEND_SUFFIXES = {
    "openai": "completions",
    "vllm": "completions",
    "openai-chat": "chat/completions",
}
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions",
                     "openai-chat": "/v1/chat/completions"}  # fmt: skip


@dataclass(frozen=True)
class RequestSpec:
    """Everything one request needs; ``extra_body`` is merged into the JSON body last."""

    api_url: str
    model: str
    prompt: str
    prompt_len: int
    output_len: int
    chat: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""


def build_payload(spec: RequestSpec) -> dict[str, Any]:
    """vLLM's body: streaming with usage; chat sends a text part and ``max_completion_tokens``."""
    payload: dict[str, Any] = {"model": spec.model}
    if spec.chat:
        content = [{"type": "text", "text": spec.prompt}]
        payload["messages"] = [{"role": "user", "content": content}]
        payload["max_completion_tokens"] = spec.output_len
    else:
        payload["prompt"] = spec.prompt
        payload["max_tokens"] = spec.output_len
        if spec.logprobs is not None:
            payload["logprobs"] = spec.logprobs
    payload["stream"] = True
    payload["stream_options"] = {"include_usage": True}
    if spec.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(spec.extra_body)
    return payload


class SSEParser:
    """Split a byte stream into ``data:`` payloads, whatever the network chunking.

    Events end at a blank line; comments (``:`` lines, used as pings) and ``event:`` lines are
    dropped; the space after ``data:`` is optional.
    """

    def __init__(self) -> None:
        self._buffer = ""
        # incremental: a multi-byte character may be split across network reads
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, chunk: bytes | str) -> list[str]:
        text = self._decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        self._buffer += text.replace("\r\n", "\n")
        payloads: list[str] = []
        while "\n\n" in self._buffer:
            event, self._buffer = self._buffer.split("\n\n", 1)
            for line in event.splitlines():
                if line.startswith("data:"):
                    payloads.append(line[len("data:") :].strip())
        return payloads

    def flush(self) -> list[str]:
        """A last event the server did not terminate with a blank line."""
        rest, self._buffer = self._buffer, ""
        return [ln[len("data:") :].strip() for ln in rest.splitlines() if ln.startswith("data:")]


class _Timer:
    """Applies vLLM's timing rules to parsed chunks."""

    def __init__(self, result: RequestResult, start: float, chat: bool) -> None:
        self.result, self.start, self.chat = result, start, chat
        self.last = start
        self.first_seen = False
        self.text: list[str] = []

    def on_chunk(self, data: dict[str, Any], now: float) -> None:
        choices = data.get("choices")
        if choices:
            if not self.first_seen:
                self.first_seen = True
                self.result.ttft = now - self.start
            else:
                self.result.itl.append(now - self.last)
            self.text.append(_chunk_text(choices[0], self.chat))
            self.last = now
        # usage usually comes alone in the last chunk; with continuous usage stats every chunk
        # carries the running total, so the last one seen wins
        usage = data.get("usage")
        if usage:
            if usage.get("completion_tokens") is not None:
                self.result.output_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                self.result.prompt_len = int(usage["prompt_tokens"])


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


async def send_request(client: httpx.AsyncClient, spec: RequestSpec) -> RequestResult:
    """Send one streamed request and time it; never raises, failures land in ``error``."""
    result = RequestResult(prompt_len=spec.prompt_len)
    headers = dict(spec.headers)
    if spec.request_id:
        headers["x-request-id"] = spec.request_id
    start = time.perf_counter()
    result.start_time = start
    timer = _Timer(result, start, spec.chat)
    try:
        async with client.stream(
            "POST", spec.api_url, json=build_payload(spec), headers=headers
        ) as r:
            if r.status_code != 200:
                result.error = await _http_error(r)
                return result
            await _consume(r, timer)
    except Exception as e:  # a benchmark counts failures; it never stops on one
        result.error = f"{type(e).__name__}: {first_line(e)}"
        return result
    result.generated_text = "".join(timer.text)
    result.latency = timer.last - start
    if not result.error and not timer.first_seen:
        result.error = "Never received a valid chunk to calculate TTFT."
    result.success = not result.error
    return result


async def _consume(response: httpx.Response, timer: _Timer) -> None:
    parser = SSEParser()
    async for chunk in response.aiter_bytes():
        now = time.perf_counter()
        if _handle(parser.feed(chunk), timer, now):
            return
    _handle(parser.flush(), timer, time.perf_counter())


def _handle(payloads: list[str], timer: _Timer, now: float) -> bool:
    """Process payloads; True once the stream is finished ([DONE] or an error event)."""
    for payload in payloads:
        if payload == "[DONE]":
            return True
        if not payload:
            continue
        data = json.loads(payload)
        if isinstance(data, dict) and data.get("error"):
            timer.result.error = f"stream error: {_error_message(data)}"
            return True
        timer.on_chunk(data, now)
    return False


async def _http_error(response: httpx.Response) -> str:
    body = (await response.aread()).decode("utf-8", errors="replace")
    try:
        message = _error_message(json.loads(body))
    except (ValueError, AttributeError):
        message = body.strip()[:200]
    return f"HTTP {response.status_code}: {message or response.reason_phrase}"


def _error_message(data: Any) -> str:
    """The message of vLLM's error envelope, its older flat form or a bare string."""
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict):
            return str(error.get("message") or error)
        if error is not None:
            return str(error)
        return str(data.get("message") or data)
    return str(data)
