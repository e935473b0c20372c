"""The engine process under the server: killed (-9) under load, the server exits non-zero within
seconds; kept alive, it answers 503s at once and never hangs; a start-up failure in the engine
process is one clear line; the thread topology (``QWENSERVE_ENABLE_MULTIPROCESSING=0``) serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from oai_server import RemoteServer, started_together

ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "16M",
        "--max-num-batched-tokens", "64"]


@pytest.fixture(scope="module")
def servers(tiny_model_path, tmp_path_factory):
    """Each test's own server (each breaks its engine), started together so their start-ups
    overlap: {"killed", "keep_alive", "threads"}."""
    envs = {"killed": {},
            "keep_alive": {"QWENSERVE_KEEP_ALIVE_ON_ENGINE_DEATH": "1",
                           "QWENSERVE_SERVER_DEV_MODE": "1"},
            "threads": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
    starts = {name: (lambda name=name, env=env: RemoteServer(
        [tiny_model_path, *ARGS], tmp_path_factory.mktemp(name) / "serve.log", env=env,
        wait=False)) for name, env in envs.items()}
    with started_together(starts, stop_signal=signal.SIGKILL) as started:
        yield started


def _engine_pid(server: RemoteServer) -> int:
    children = psutil.Process(server.proc.pid).children()
    pids = [c.pid for c in children if "qwenserve.engine.core_proc" in " ".join(c.cmdline())]
    assert len(pids) == 1, [c.cmdline() for c in children]
    return pids[0]


def _load(server: RemoteServer, results: list) -> list[threading.Thread]:
    """Four long streams, each recording how it ended."""

    def one() -> None:
        payload = {"prompt": "Hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
        lines = []
        try:
            with httpx.stream("POST", server.base_url + "/v1/completions", json=payload,
                              timeout=60) as r:
                lines = [line for line in r.iter_lines() if line]
        except httpx.HTTPError as e:
            lines.append(repr(e))
        results.append(lines)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    return threads


def _wait_streaming(server: RemoteServer) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.metrics().get("vllm:num_requests_running", 0) >= 1:
            return
        time.sleep(0.05)
    raise AssertionError("no request started")


def test_engine_killed_under_load_server_exits_nonzero(servers):
    server = servers["killed"]
    try:
        results: list = []
        threads = _load(server, results)
        _wait_streaming(server)
        os.kill(_engine_pid(server), signal.SIGKILL)
        start = time.monotonic()
        code = server.proc.wait(timeout=30)
        assert time.monotonic() - start < 15
        for t in threads:
            t.join(timeout=30)
    finally:
        server.stop(signal.SIGKILL)
    assert code == 1, server.log()[-3000:]
    assert "killed by SIGKILL" in server.log()
    # Each stream ended with an error event (or a cut connection), none as if it had finished.
    assert len(results) == 4 and all(any("error" in line.lower() for line in r) for r in results)


def test_keep_alive_on_engine_death_answers_503_and_never_hangs(servers):
    server = servers["keep_alive"]
    try:
        results: list = []
        threads = _load(server, results)
        _wait_streaming(server)
        os.kill(_engine_pid(server), signal.SIGKILL)
        for t in threads:
            t.join(timeout=20)
            assert not t.is_alive()
        # Every stream ended with an error event, not a hang.
        assert all(any('"error"' in line for line in r) for r in results), results
        deadline = time.monotonic() + 10
        while server.get("/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.get("/health").status_code == 503
        start = time.monotonic()
        r = server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=10)
        assert r.status_code == 503  # the body names a log reference, not internals
        r = server.post("/reset_prefix_cache", timeout=10)  # answered at once, not hung
        assert r.status_code >= 500
        assert time.monotonic() - start < 5
        m = server.metrics()
        assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
        assert server.proc.poll() is None
        start = time.monotonic()
        assert server.stop(signal.SIGTERM) == 0
        assert time.monotonic() - start < 15
    finally:
        server.stop(signal.SIGKILL)


def test_engine_start_failure_is_one_clear_line(tmp_path):
    missing = str(tmp_path / "no-such-model")
    proc = subprocess.run(
        [sys.executable, "-m", "qwenserve.entrypoints.cli", "serve", missing, "--port", "0",
         "--host", "127.0.0.1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Cannot start the server" in errors[0], proc.stderr[-3000:]
    assert "no-such-model" in errors[0] and "Traceback" not in proc.stderr


def test_thread_topology_serves(servers):
    server = servers["threads"]
    try:
        assert not psutil.Process(server.proc.pid).children()
        r = server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5,
                                                 "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        assert server.stop(signal.SIGTERM) == 0
