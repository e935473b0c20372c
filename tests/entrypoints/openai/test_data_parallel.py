"""Data parallelism on real processes: ``--data-parallel-size 2`` (two engine-core processes
behind one server), a ``--headless`` node joining a head over loopback TCP, and one replica
killed. Per-engine figures come from /metrics' ``engine`` label, as vLLM reports them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from oai_server import RemoteServer

from helpers.dp_serving import per_engine
from helpers.ports import free_port_block

ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "16M",
        "--max-num-batched-tokens", "256"]
PROMPTS = [f"Replica test {i}: the quick brown fox" for i in range(8)]


def _engine_pids(server: RemoteServer) -> list[int]:
    children = psutil.Process(server.proc.pid).children()
    return [c.pid for c in children if "qwenserve.engine.core_proc" in " ".join(c.cmdline())]


def _complete(server: RemoteServer, prompt, max_tokens: int = 16, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _burst(server: RemoteServer, prompts: list, **extra) -> list[dict]:
    results: list[dict] = [{}] * len(prompts)

    def one(i: int) -> None:
        results[i] = _complete(server, prompts[i], **extra)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


@pytest.fixture(scope="module")
def dp_server(tiny_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("dp") / "serve.log"
    server = RemoteServer([tiny_model_path, *ARGS, "--data-parallel-size", "2",
                           "--enable-prompt-tokens-details"], log,
                          env={"QWENSERVE_SERVER_DEV_MODE": "1"})
    yield server
    server.stop(signal.SIGKILL)


def test_two_engines_serve_greedy_outputs_equal_to_one_engine(dp_server, tiny_model_path):
    from qwenserve import LLM, SamplingParams

    assert len(_engine_pids(dp_server)) == 2
    # 96 tokens each: a request must still be in flight when the next one is routed (16-token
    # requests of the tiny model could finish first on a loaded machine: all to engine 0)
    results = _burst(dp_server, PROMPTS, max_tokens=96)
    llm = LLM(tiny_model_path, dtype="float32", max_model_len=512,
              kv_cache_memory_bytes=16 << 20)
    reference = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=96))
    assert [r["choices"][0]["text"] for r in results] == [o.outputs[0].text for o in reference]
    # the burst was spread: each engine finished some of it
    done = per_engine(dp_server, "vllm:request_success_total", finished_reason="length")
    assert set(done) == {"0", "1"} and min(done.values()) >= 2, done


def _start_long(server: RemoteServer, prompt: list[int]) -> tuple[threading.Thread, str]:
    """A 440-token request in a thread, once it runs: (the thread, the engine running it)."""
    before = per_engine(server, "vllm:num_requests_running")
    thread = threading.Thread(target=_complete, args=(server, prompt),
                              kwargs={"max_tokens": 440, "ignore_eos": True})
    thread.start()
    deadline = time.monotonic() + 30
    while True:
        running = per_engine(server, "vllm:num_requests_running")
        busier = [e for e, n in running.items() if n > before.get(e, 0)]
        if busier:
            return thread, busier[0]
        assert time.monotonic() < deadline, running
        time.sleep(0.05)


def test_a_shared_prefix_stays_on_the_engine_that_cached_it(dp_server):
    """Requests sharing a cached prefix go to the engine that holds it, even while that engine
    is the busier one (by load alone they would go to the other)."""
    prefix = list(range(300, 364))  # four full blocks
    queries = per_engine(dp_server, "vllm:prefix_cache_queries_total")
    _complete(dp_server, [*prefix, 1])
    after = per_engine(dp_server, "vllm:prefix_cache_queries_total")
    holder = next(e for e in after if after[e] > queries.get(e, 0))  # where the prefix went
    other = next(e for e in after if e != holder)
    hits_before = per_engine(dp_server, "vllm:prefix_cache_hits_total")
    # a long request with the prefix goes to its holder and keeps that engine the busier one
    long_one, engine = _start_long(dp_server, [*prefix, 90])
    assert engine == holder
    cached = [_complete(dp_server, [*prefix, 2 + i])["usage"]["prompt_tokens_details"]
              ["cached_tokens"] for i in range(3)]
    long_one.join(timeout=120)
    assert cached == [64, 64, 64]
    hits = per_engine(dp_server, "vllm:prefix_cache_hits_total")
    assert hits[holder] - hits_before.get(holder, 0) == 4 * 64  # the long one's too
    assert hits[other] == hits_before.get(other, 0)


def test_reset_prefix_cache_reaches_every_engine(dp_server):
    r = dp_server.post("/reset_prefix_cache")
    assert r.status_code == 200, r.text
    prefix_b = list(range(300, 364))
    assert _complete(dp_server, [*prefix_b, 9])["usage"]["prompt_tokens_details"] \
        ["cached_tokens"] == 0


def test_killing_one_engine_takes_the_server_down(dp_server):
    """Last in this module: one replica dies, the server exits 1 naming it (today's policy for
    an engine death), and the other engine follows its API process out."""
    survivor, victim = _engine_pids(dp_server)
    os.kill(victim, signal.SIGKILL)
    code = dp_server.proc.wait(timeout=30)
    assert code == 1, dp_server.log()[-3000:]
    assert "data-parallel engine" in dp_server.log() and "killed by SIGKILL" in dp_server.log()
    deadline = time.monotonic() + 15
    while psutil.pid_exists(survivor) and time.monotonic() < deadline:
        if psutil.Process(survivor).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.1)
    assert not psutil.pid_exists(survivor) or \
        psutil.Process(survivor).status() == psutil.STATUS_ZOMBIE


def test_a_headless_node_joins_the_head_over_loopback(tiny_model_path, tmp_path):
    port = free_port_block(1)  # below the ephemeral range (see test_data_parallel_expert.py)
    dp_flags = ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
                "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port)]
    node_log = tmp_path / "node.log"
    env = {**os.environ, "QWENSERVE_LOGGING_LEVEL": "INFO"}
    with open(node_log, "w") as log:  # the node may start first: it waits for the head
        node = subprocess.Popen([sys.executable, "-m", "qwenserve.entrypoints.cli", "serve",
                                 tiny_model_path, *ARGS, *dp_flags, "--headless",
                                 "--data-parallel-start-rank", "1"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        head = RemoteServer([tiny_model_path, *ARGS, *dp_flags], tmp_path / "head.log")
        try:
            assert "Data-parallel rank 1 joined" in head.log()
            assert len(_engine_pids(head)) == 1  # the other engine runs under the node
            results = _burst(head, PROMPTS[:4], max_tokens=96)  # in flight side by side
            assert all(r["choices"][0]["finish_reason"] == "length" for r in results)
            done = per_engine(head, "vllm:request_success_total", finished_reason="length")
            assert set(done) == {"0", "1"} and min(done.values()) >= 1, done
        finally:
            assert head.stop() == 0, head.log()[-3000:]
        # the head told the node's engine to stop: the node exits cleanly
        assert node.wait(timeout=60) == 0, node_log.read_text()[-3000:]
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_a_node_without_a_head_gives_up_with_a_clear_line(tiny_model_path):
    port = free_port_block(1)
    node = subprocess.run(
        [sys.executable, "-m", "qwenserve.entrypoints.cli", "serve", tiny_model_path, *ARGS,
         "--headless", "--data-parallel-size", "2", "--data-parallel-start-rank", "1",
         "--data-parallel-rpc-port", str(port)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "QWENSERVE_ENGINE_READY_TIMEOUT_S": "2"})
    assert node.returncode == 1
    assert f"No head answered at 127.0.0.1:{port}" in node.stderr + node.stdout
