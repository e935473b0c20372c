"""A prefill (kv_producer) and a decode (kv_consumer) server on 127.0.0.1, and the proxy."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints" / "openai"))

from oai_server import RemoteServer, free_port, started_together  # noqa: E402
from pd_helpers import serve_args  # noqa: E402

PULL_TIMEOUT_S = "3"


@pytest.fixture(scope="session")
def pd_model(tiny_model) -> str:
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def pd_pair(pd_model, tmp_path_factory):
    """(producer, consumer), started together so their start-ups overlap."""
    with started_together({
        "producer": lambda: RemoteServer(
            serve_args(pd_model, "kv_producer", free_port(), "prefill-0"),
            tmp_path_factory.mktemp("producer") / "serve.log", wait=False),
        "consumer": lambda: RemoteServer(
            serve_args(pd_model, "kv_consumer", free_port(), "decode-0"),
            tmp_path_factory.mktemp("consumer") / "serve.log",
            env={"QWENSERVE_KV_PULL_TIMEOUT_S": PULL_TIMEOUT_S}, wait=False),
    }) as started:
        yield started["producer"], started["consumer"]


@pytest.fixture(scope="session")
def producer(pd_pair):
    return pd_pair[0]


@pytest.fixture(scope="session")
def consumer(pd_pair):
    return pd_pair[1]


@pytest.fixture(scope="session")
def proxy(producer, consumer, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("proxy") / "proxy.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qwenserve.entrypoints.cli", "disagg-proxy", "--prefill",
             producer.base_url, "--decode", consumer.base_url, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"proxy did not start:\n{log_path.read_text()}")
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=10)
