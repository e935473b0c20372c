"""``--api-server-count 2``: two API processes on one port and one engine. Concurrent requests
from the official ``openai`` client are all answered (and equal one process's answers), both
processes serve, ``/metrics`` from either counts every request once, SIGTERM drains with no
process left behind, and an API process that dies takes the server down."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
from oai_server import RemoteServer, started_together

PROMPTS = ["Hello", "The capital of France is", "def add(a, b):", "你好"]


def _start(model: str, log_dir) -> RemoteServer:
    """Spawned, not yet ready (``wait_ready()``): the module's two servers start together."""
    return RemoteServer([model, "--api-server-count", "2", "--dtype", "float32",
                         "--max-model-len", "256", "--kv-cache-memory-bytes", "16M",
                         "--shutdown-timeout", "20"], log_dir / "serve.log", wait=False)


def _children(srv: RemoteServer) -> list[int]:
    """The launcher's child processes (API processes first, from its log; then the engine)."""
    api = re.search(r"API server processes \(pids ([\d, ]+)\)", srv.log()).group(1)
    pids = [int(p) for p in api.split(", ")]
    with open(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children") as f:
        return pids + [int(p) for p in f.read().split() if int(p) not in pids]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its parent is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def servers(tiny_model_path, tmp_path_factory):
    """Two servers, started together so their start-ups overlap: the one most tests share, and
    one for the test that kills an API process."""
    with started_together({
        "shared": lambda: _start(tiny_model_path, tmp_path_factory.mktemp("multi-api")),
        "doomed": lambda: _start(tiny_model_path, tmp_path_factory.mktemp("multi-api-doomed")),
    }) as started:
        yield started["shared"], started["doomed"]


@pytest.fixture(scope="module")
def served(servers):
    return servers[0]


async def _ask_all(srv: RemoteServer, model: str, n: int) -> list[tuple[str, str, int]]:
    """n concurrent completions through the openai client: (prompt, text, API process)."""
    client = srv.async_client()

    async def one(i: int) -> tuple[str, str, int]:
        prompt = PROMPTS[i % len(PROMPTS)]
        raw = await client.completions.with_raw_response.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0)
        return prompt, raw.parse().choices[0].text, int(raw.headers["x-qwenserve-api-server"])

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


def test_concurrent_requests_are_all_answered_by_both_processes(served):
    srv = served
    model = srv.get("/v1/models").json()["data"][0]["id"]
    assert srv.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200
    before = srv.wait_idle()  # the engine's series exist from its first step
    results = asyncio.run(_ask_all(srv, model, 32))
    seen = {index for _, _, index in results}
    for _ in range(5):  # the kernel picks the accepting process: try again if one got all
        if seen == {0, 1}:
            break
        more = asyncio.run(_ask_all(srv, model, 16))
        results += more
        seen |= {index for _, _, index in more}
    assert seen == {0, 1}
    by_prompt: dict[str, set[str]] = {}
    for prompt, text, _ in results:
        by_prompt.setdefault(prompt, set()).add(text)
    assert all(len(texts) == 1 for texts in by_prompt.values()), by_prompt  # greedy: one answer
    # /metrics from either process (fetched several times) counts every request once
    after = srv.wait_idle()
    done = after["vllm:request_success_total{finished_reason=length}"] - before.get(
        "vllm:request_success_total{finished_reason=length}", 0)
    assert done == len(results)
    tokens = after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0)
    assert tokens == 6 * len(results)
    for _ in range(6):
        again = srv.metrics()
        assert again["vllm:generation_tokens_total"] == after["vllm:generation_tokens_total"]


def test_same_request_id_in_both_processes(served):
    """Each process's ids live apart in the engine (the hub renames them)."""
    srv = served

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
            return await asyncio.gather(*(client.post(
                "/v1/completions", headers={"X-Request-Id": "same-id"},
                json={"prompt": "Hello", "max_tokens": 4}) for _ in range(16)))

    responses = asyncio.run(go())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]


def test_a_dying_api_process_takes_the_server_down(servers):
    srv = servers[1]
    children = _children(srv)
    os.kill(children[1], signal.SIGKILL)
    assert srv.proc.wait(timeout=60) == 1
    assert "API server process 1" in srv.log() and "shutting the server down" in srv.log()
    assert _wait_gone(children) == []


def test_sigterm_drains_both_and_leaves_no_process(served):
    """Last on the module's server: it stops it."""
    srv = served
    children = _children(srv)
    assert len(children) == 3
    with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=60,
                      json={"prompt": "Hello", "max_tokens": 60, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        srv.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert first.startswith("data:") and rest[-1] == "data: [DONE]"
    assert srv.proc.wait(timeout=60) == 0, srv.log()[-3000:]
    assert _wait_gone(children) == []
