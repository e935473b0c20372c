"""ASGI middleware: API keys, the request-body limit, draining, ``X-Request-Id`` echo.

Pure ASGI (not ``BaseHTTPMiddleware``) so that streamed responses pass through untouched and a
client disconnect still reaches the endpoint.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qwenserve.entrypoints.openai.errors import error_body

# vLLM guards only these prefixes; /health, /metrics, /tokenize, /version stay open.
GUARDED_PREFIXES = ("/v1",)


async def send_error(
    send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps(error_body(message, status)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def route_path(scope: Scope) -> str:
    """The path the router matches: uvicorn puts ``--root-path`` in front of ``scope["path"]``,
    so every path decision (auth, drain) must look at the path without it, exactly as
    Starlette's router strips it (same rule: only at a ``/`` boundary)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if len(path) == len(root):
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def key_digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class AuthMiddleware:
    """``Authorization: Bearer <key>`` on /v1 routes. Keys are compared as SHA-256 digests in
    constant time: equal lengths, so the time taken tells nothing about a key's length."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.digests = [key_digest(k.encode()) for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") == "OPTIONS"
            or not route_path(scope).startswith(GUARDED_PREFIXES)
        ):
            return await self.app(scope, receive, send)
        given = _header(scope, b"authorization") or b""
        token = given[7:] if given[:7].lower() == b"bearer " else b""
        # Compare against every key (no early exit) so timing reveals nothing about which failed.
        given_digest = key_digest(token)
        matches = [hmac.compare_digest(given_digest, d) for d in self.digests]
        if not any(matches):
            return await send_error(
                send,
                401,
                "Unauthorized: a valid API key is required (Authorization: Bearer <key>)",
                [(b"www-authenticate", b"Bearer")],
            )
        return await self.app(scope, receive, send)


class BodyTooLarge(HTTPException):
    """Raised from ``receive``; an HTTPException so FastAPI's body parser passes it through."""


class BodyLimitMiddleware:
    """413 for request bodies over ``max_bytes``: by ``Content-Length`` before reading anything,
    and by counting for chunked uploads."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(send, 413, self._message())
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(413, self._message())
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await send_error(send, 413, self._message())

    def _message(self) -> str:
        return (
            f"Request body is larger than the server's limit of {self.max_bytes} bytes "
            "(--max-request-body-bytes)"
        )


class ServerStateMiddleware:
    """Refuses new /v1 work while draining (SIGTERM received) and, with
    ``--enable-request-id-headers``, answers with an ``X-Request-Id`` header."""

    def __init__(self, app: ASGIApp, state: Any, echo_request_id: bool) -> None:
        self.app = app
        self.state = state
        self.echo_request_id = echo_request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.state.draining and route_path(scope).startswith(GUARDED_PREFIXES):
            return await send_error(send, 503, "The server is shutting down")
        if not self.echo_request_id:
            return await self.app(scope, receive, send)
        # As vLLM's --enable-request-id-headers: the client's id, or a fresh one.
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", request_id)],
                }
            await send(message)

        return await self.app(scope, receive, send_with_id)
