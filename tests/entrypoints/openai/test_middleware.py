"""The ASGI middleware in-process: path decisions without the root path, keys compared as
equal-length digests."""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import pytest

from qwenserve.entrypoints.openai import middleware
from qwenserve.entrypoints.openai.middleware import AuthMiddleware, route_path


async def _ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize(
    ("path", "root", "expected"),
    [("/v1/models", "", "/v1/models"), ("/api/v1/models", "/api", "/v1/models"),
     ("/api", "/api", ""), ("/apiv1/models", "/api", "/apiv1/models"),
     ("/v1/models", "/api", "/v1/models")],
)  # fmt: skip
def test_route_path_strips_the_root_path_like_the_router(path, root, expected):
    assert route_path({"path": path, "root_path": root}) == expected


def test_keys_are_compared_as_sha256_digests(monkeypatch):
    compared: list[tuple[int, int]] = []
    real = middleware.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    app = AuthMiddleware(_ok, ["k" * 40, "short"])
    assert app.digests == [hashlib.sha256(b"k" * 40).digest(), hashlib.sha256(b"short").digest()]

    async def statuses() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [
                (await client.get("/v1/models", headers={"Authorization": f"Bearer {k}"}))
                .status_code
                for k in ("k" * 40, "short", "x", "k" * 41)
            ]

    assert asyncio.run(statuses()) == [200, 200, 401, 401]
    assert compared and set(compared) == {(32, 32)}


def test_draining_refuses_v1_behind_the_root_path():
    """uvicorn's scope for ``GET /v1/models`` with ``--root-path /api``: path ``/api/v1/models``."""
    from types import SimpleNamespace

    from qwenserve.entrypoints.openai.middleware import ServerStateMiddleware

    app = ServerStateMiddleware(_ok, SimpleNamespace(draining=True), echo_request_id=False)
    sent: list[dict] = []

    async def send(message) -> None:
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": "GET", "path": "/api/v1/models", "root_path": "/api",
             "headers": []}  # fmt: skip
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 503
    sent.clear()
    asyncio.run(app({**scope, "path": "/api/health"}, receive, send))
    assert sent[0]["status"] == 200
