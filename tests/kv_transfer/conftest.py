"""A prefill (kv_producer) and a decode (kv_consumer) server on 127.0.0.1, and the proxy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints" / "openai"))

from oai_server import RemoteServer, free_port  # noqa: E402

PULL_TIMEOUT_S = "3"


def kv_config(role: str, kv_port: int, engine_id: str, tp: int = 1) -> dict:
    return {"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": str(kv_port),
            "engine_id": engine_id, "kv_ip": "127.0.0.1",
            "kv_connector_extra_config": {"use_ascend_direct": True,
                                          "prefill": {"dp_size": 1, "tp_size": tp},
                                          "decode": {"dp_size": 1, "tp_size": tp}}}


def serve_args(model: str, role: str, kv_port: int, engine_id: str, tp: int = 1) -> list[str]:
    return [model, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes",
            "16M", "--disable-uvicorn-access-log", "-tp", str(tp), "--kv-transfer-config",
            json.dumps(kv_config(role, kv_port, engine_id, tp))]


@pytest.fixture(scope="session")
def pd_model(tiny_model) -> str:
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def producer(pd_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("producer") / "serve.log"
    srv = RemoteServer(serve_args(pd_model, "kv_producer", free_port(), "prefill-0"), log)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def consumer(pd_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("consumer") / "serve.log"
    srv = RemoteServer(serve_args(pd_model, "kv_consumer", free_port(), "decode-0"), log,
                       env={"QWENSERVE_KV_PULL_TIMEOUT_S": PULL_TIMEOUT_S})
    yield srv
    srv.stop()


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
