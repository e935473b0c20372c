"""The soak run (``benchmarks/soak.py``) at CI size: mixed traffic, disconnects and preemption
leave no 5xx, no incomplete response, nothing running and no KV block in use."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from oai_server import RemoteServer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from soak import SERVER_FLAGS, run_soak  # noqa: E402


@pytest.fixture(scope="module")
def soak_server(tiny_model_path, tmp_path_factory) -> RemoteServer:
    log = tmp_path_factory.mktemp("soak") / "serve.log"
    srv = RemoteServer([tiny_model_path, "--served-model-name", "soak", *SERVER_FLAGS], log)
    yield srv
    srv.stop()


def _check(soak_server: RemoteServer, requests: int) -> None:
    report = asyncio.run(run_soak(soak_server.base_url, "soak", requests, concurrency=12))
    assert report.server_errors == 0 and report.incomplete == 0, report.problems[:5]
    assert report.running_after == 0 and report.kv_usage_after == 0, report
    assert report.disconnects > 0 and report.preemptions > 0, report
    assert report.completed + report.disconnects + report.client_errors == requests
    assert soak_server.get("/health").status_code == 200


def test_soak_ci(soak_server):
    _check(soak_server, 120)


@pytest.mark.benchmark
def test_soak_full(soak_server):
    _check(soak_server, 1000)
