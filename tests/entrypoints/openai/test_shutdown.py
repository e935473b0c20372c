"""SIGTERM drains: running requests finish, new connections are refused, the process exits 0;
past ``--shutdown-timeout`` the rest is aborted and the exit is still clean."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from oai_server import RemoteServer, started_together


def _stream(server: RemoteServer, max_tokens: int, result: dict) -> None:
    payload = {"prompt": "Hello", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    chunks = []
    try:
        with httpx.stream(
            "POST", server.base_url + "/v1/completions", json=payload, timeout=60
        ) as r:
            for line in r.iter_lines():
                if line:
                    chunks.append(line)
                    result.setdefault("first_at", time.monotonic())
    except httpx.HTTPError as e:
        result["error"] = repr(e)
    result["chunks"] = chunks


def _start(tmp_path_factory, name: str, timeout_s: float, model: str) -> RemoteServer:
    return RemoteServer(
        [
            model,
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--kv-cache-memory-bytes",
            "32M",
            "--shutdown-timeout",
            str(timeout_s),
            "--max-num-batched-tokens",
            "64",
        ],
        tmp_path_factory.mktemp(name) / "serve.log",
        wait=False,
    )


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_path):
    """Each test's own server (each stops it), started together so their start-ups overlap:
    "drain" (a 30 s grace period) and "abort" (0.2 s)."""
    starts = {name: (lambda name=name, grace_s=grace_s: _start(tmp_path_factory, name, grace_s,
                                                            tiny_model_path))
              for name, grace_s in (("drain", 30), ("abort", 0.2))}
    with started_together(starts, stop_signal=signal.SIGKILL) as started:
        yield started


def _run_stream_then_signal(server: RemoteServer, max_tokens: int, sig: int) -> dict:
    result: dict = {}
    thread = threading.Thread(target=_stream, args=(server, max_tokens, result))
    thread.start()
    deadline = time.monotonic() + 30
    while "first_at" not in result and time.monotonic() < deadline:
        time.sleep(0.01)
    server.proc.send_signal(sig)
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url + "/health", timeout=2)
    thread.join(timeout=60)
    result["exit_code"] = server.proc.wait(timeout=60)
    return result


def test_sigterm_lets_the_running_stream_finish(servers):
    server = servers["drain"]
    try:
        result = _run_stream_then_signal(server, 500, signal.SIGTERM)
    finally:
        server.stop(signal.SIGKILL)
    chunks = result["chunks"]
    assert "error" not in result and chunks[-1] == "data: [DONE]"
    last = json.loads(chunks[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "length"
    assert result["exit_code"] == 0, server.log()[-2000:]
    assert "Received SIGTERM" in server.log()


def test_sigint_past_the_grace_period_aborts_and_exits_0(servers):
    """Requests still open after the grace period end cleanly: a stream with an error event and
    ``[DONE]``, a non-streaming request with a 503 JSON body; the log names the shutdown."""
    server = servers["abort"]
    plain: dict = {}

    def post() -> None:
        body = {"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True}
        plain["r"] = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)

    waiter = threading.Thread(target=post)
    waiter.start()
    try:
        result = _run_stream_then_signal(server, 1000, signal.SIGINT)
        waiter.join(timeout=60)
    finally:
        server.stop(signal.SIGKILL)
    assert result["exit_code"] == 0, server.log()[-2000:]
    chunks = result["chunks"]
    assert chunks[-1] == "data: [DONE]"  # cut off after 0.2 s of 1000 tokens, but cleanly
    error = json.loads(chunks[-2][len("data: ") :])["error"]
    assert error["code"] == 503 and "--shutdown-timeout" in error["message"]
    assert plain["r"].status_code == 503 and "--shutdown-timeout" in plain["r"].text
    log = server.log()
    assert "Received SIGINT" in log
    assert "abort (server shutting down)" in log and "client left" not in log
