"""SSE and disconnect plumbing shared by the streaming and non-streaming handlers.

A client that goes away must stop its request at once (its KV blocks return to the pool): the
streaming response races the body against ``http.disconnect`` (for every ASGI version, not only
the pre-2.4 path Starlette takes on its own) and always closes the body iterator, which closes
the engine's generator, which aborts the request. Non-streaming handlers run under
``cancel_on_disconnect`` for the same effect.

Past ``--shutdown-timeout`` the server's ``stop`` event fires: an open stream ends with an SSE
error event and ``[DONE]``, a waiting non-streaming request gets a 503 JSON body, so clients
learn why instead of seeing a cut connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from qwenserve.entrypoints.openai.errors import OpenAIError, error_body

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


def _dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def sse(payload: dict[str, Any]) -> str:
    return f"data: {_dumps(payload)}\n\n"


class ChunkEncoder:
    """One stream's SSE chunks with the fields every chunk repeats (``id``, ``object``,
    ``created``, ``model``) encoded once: per token only the changing fields are encoded.
    ``encode(fields)`` equals ``sse({**head, **fields})`` byte for byte."""

    def __init__(self, head: dict[str, Any]) -> None:
        self._prefix = "data: " + _dumps(head)[:-1] + ","

    def encode(self, fields: dict[str, Any]) -> str:
        return self._prefix + _dumps(fields)[1:] + "\n\n"


SHUTDOWN_MESSAGE = (
    "The server is shutting down and aborted this request after its grace period "
    "(--shutdown-timeout); retry on another replica"
)


def shutdown_error_body() -> dict[str, Any]:
    return error_body(SHUTDOWN_MESSAGE, 503)


class DisconnectAwareStreamingResponse(StreamingResponse):
    """``text/event-stream`` whose body is cancelled and closed when the client disconnects,
    or ended with an error event and ``[DONE]`` when ``stop`` fires (shutdown)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], stop: asyncio.Event | None = None) -> None:
        super().__init__(content)
        self.stop = stop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = stopped = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(tracking_send)
                    except OSError:  # the client vanished while we were sending
                        pass
                    tg.cancel_scope.cancel()

                async def watch_stop() -> None:
                    nonlocal stopped
                    await self.stop.wait()  # type: ignore[union-attr]
                    stopped = True
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                if self.stop is not None:
                    tg.start_soon(watch_stop)
                await _wait_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
        if stopped and started:
            end = (sse(shutdown_error_body()) + DONE).encode()
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": end, "more_body": False})


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(
    request: Request, work: Awaitable[T], stop: asyncio.Event | None = None
) -> T | None:
    """Run ``work``; if the client disconnects first, cancel it (aborting its engine requests)
    and return None (nobody is left to read a response). If ``stop`` fires first (shutdown past
    its grace period), cancel it and raise a 503."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    stopper = asyncio.ensure_future(stop.wait() if stop is not None else asyncio.Event().wait())
    try:
        done, _ = await asyncio.wait(
            {task, watcher, stopper}, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if stopper in done:
            raise OpenAIError(SHUTDOWN_MESSAGE, 503)
        return None
    finally:
        watcher.cancel()
        stopper.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive: yields (iterator index, item).

    Used for a completions request with several prompts. Exceptions propagate; on exit every
    iterator is closed (aborting its engine request if it had not finished). One iterator (one
    prompt, the usual case) is read directly: a task and a queue between would cost every
    streamed token two more wake-ups of the event loop.
    """
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            aclose = getattr(iterators[0], "aclose", None)
            if aclose is not None:
                await aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    sentinel = object()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
            await queue.put((i, sentinel))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is sentinel:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for it in iterators:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()


async def chain_first(first: T | None, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """``first`` (an item already pulled from ``rest``), then the rest of ``rest``."""
    if first is not None:
        yield first
    async for item in rest:
        yield item
