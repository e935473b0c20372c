"""Hostile and careless clients against a real server behind ``--root-path`` with ``--api-key``
(issue 13): every path decision ignores the root path, limits answer with the flag to change."""

from __future__ import annotations

import httpx
import pytest
from oai_server import API_KEY, SERVED, RemoteServer

ROOT = "/api"


@pytest.fixture(scope="module")
def guarded(tiny_model_path, tmp_path_factory) -> RemoteServer:
    log = tmp_path_factory.mktemp("guarded") / "serve.log"
    srv = RemoteServer(
        [
            tiny_model_path,
            "--served-model-name",
            SERVED,
            "--api-key",
            API_KEY,
            "--root-path",
            ROOT,
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--kv-cache-memory-bytes",
            "16M",
            "--disable-uvicorn-access-log",
        ],
        log,
        api_key=API_KEY,
    )
    yield srv
    srv.stop()


def test_root_path_keeps_the_api_key_required(guarded):
    """uvicorn puts the root path in front of ``scope["path"]``; auth must still see ``/v1``.
    (The proxy in front strips the root path, so clients reach ``/v1/...`` here.)"""
    url = guarded.base_url
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
    body = {"model": SERVED, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
    ok = httpx.get(url + "/v1/models", headers=guarded.headers, timeout=30)
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == SERVED
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # open, as in vLLM
    # With the prefix left on, the router sees /api/v1/models: no route, and never a 200.
    assert httpx.get(url + ROOT + "/v1/models", timeout=30).status_code in (401, 404)


def test_without_root_path_the_key_is_required(server):
    assert httpx.get(server.base_url + "/v1/models", timeout=30).status_code == 401
