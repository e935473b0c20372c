"""Data parallelism with expert parallelism on real processes (``--data-parallel-size 2
--enable-expert-parallel``): two engine-core replicas form one MoE group (each holds half the
experts) and step together, an idle replica running dummy steps. Greedy outputs equal one
device's, with requests on both replicas at once and with one replica idle; the same across a
head and a ``--headless`` node (the group meets over TCP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest
from oai_server import RemoteServer, free_port

ARGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "16M",
        "--max-num-batched-tokens", "64", "--data-parallel-size", "2",
        "--enable-expert-parallel"]


@pytest.fixture(scope="module")
def moe_path(tiny_model) -> str:
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def dpep_server(moe_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("dpep") / "serve.log"
    server = RemoteServer([moe_path, *ARGS], log, env={"QWENSERVE_SERVER_DEV_MODE": "1"})
    yield server
    server.stop(signal.SIGTERM)


def _complete(server: RemoteServer, prompt: list[int], max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _reference(path: str, prompts: list[list[int]], max_tokens: list[int]) -> list[str]:
    from qwenserve import LLM, SamplingParams

    llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                         for n in max_tokens])
    llm.llm_engine.shutdown()
    return [o.outputs[0].text for o in outs]


def test_two_replicas_one_moe_group_equal_one_device(dpep_server, moe_path):
    pids = [c.pid for c in psutil.Process(dpep_server.proc.pid).children()
            if "qwenserve.engine.core_proc" in " ".join(c.cmdline())]
    assert len(pids) == 2
    prompts = [[5, 17, 99, 3], list(range(10, 60)), [7, 300, 12], [42] * 9]
    max_tokens = [12, 3, 8, 1]  # replicas finish at different steps: one idles, one steps
    got = [""] * len(prompts)

    def one(i: int) -> None:
        got[i] = _complete(dpep_server, prompts[i], max_tokens[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    lone = _complete(dpep_server, prompts[0], 6)  # alone: the other replica runs dummy steps
    want = _reference(moe_path, [*prompts, prompts[0]], [*max_tokens, 6])
    assert [*got, lone] == want
    done = [line for line in dpep_server.get("/metrics").text.splitlines()
            if line.startswith("vllm:request_success_total{")]
    for engine in ("0", "1"):  # both replicas served some of it
        assert any(f'engine="{engine}"' in line and not line.endswith(" 0.0") for line in done)


def test_a_headless_node_joins_the_moe_group(moe_path, tmp_path):
    port = free_port()
    flags = [*ARGS, "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
             "--data-parallel-rpc-port", str(port)]
    node_log = tmp_path / "node.log"
    with open(node_log, "w") as log:  # the node may start first: it waits for the head
        node = subprocess.Popen([sys.executable, "-m", "qwenserve.entrypoints.cli", "serve",
                                 moe_path, *flags, "--headless", "--data-parallel-start-rank",
                                 "1"], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "QWENSERVE_LOGGING_LEVEL": "INFO"})
    try:
        head = RemoteServer([moe_path, *flags], tmp_path / "head.log")
        try:
            prompts, max_tokens = [[5, 17, 99, 3], [7, 300, 12]], [7, 2]
            got = [""] * 2
            threads = [threading.Thread(target=lambda i=i: got.__setitem__(
                i, _complete(head, prompts[i], max_tokens[i]))) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert got == _reference(moe_path, prompts, max_tokens)
        finally:
            assert head.stop() == 0, head.log()[-3000:]
        assert node.wait(timeout=60) == 0, node_log.read_text()[-3000:]  # stopped with the head
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
