"""Data-parallel servers for the DP x EP tests (``test_data_parallel_expert.py``,
``test_data_parallel_spec.py``): start one, send greedy token-id prompts to it at once (so both
replicas are busy, then one idles), read per-replica metrics, and the one-engine reference the
served text must equal."""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from pathlib import Path

from oai_server import RemoteServer


def dp_server(model: str, flags: Sequence[str], log_path: Path) -> RemoteServer:
    """``qwenserve serve model *flags`` with the dev endpoints on (the tests reset caches)."""
    return RemoteServer([model, *flags], log_path, env={"QWENSERVE_SERVER_DEV_MODE": "1"})


def stop_cleanly(server: RemoteServer) -> None:
    """SIGTERM drains every replica: anything but exit 0 is a failure, shown with the log."""
    assert server.stop(signal.SIGTERM) == 0, server.log()[-3000:]


def complete(server: RemoteServer, prompt: list[int], max_tokens: int,
             timeout_s: float = 120) -> str:
    """Greedy text of one completion, ``ignore_eos`` so the length is exact."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = server.post("/v1/completions", json=body, timeout=timeout_s)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def complete_at_once(server: RemoteServer, prompts: Sequence[list[int]],
                     max_tokens: Sequence[int], join_timeout_s: float = 150) -> list[str]:
    """The prompts concurrently (one thread each). A thread still running after the timeout
    means a request hung, in DP x EP most likely replicas whose MoE passes diverged."""
    got = [""] * len(prompts)

    def one(i: int) -> None:
        got[i] = complete(server, prompts[i], max_tokens[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=join_timeout_s)
    assert not any(t.is_alive() for t in threads), "a request hung: the replicas' passes " \
        "diverged\n" + server.log()[-3000:]
    return got


def per_engine(server: RemoteServer, name: str, **labels: str) -> dict[str, float]:
    """``{engine: value}`` of one metric's samples matching ``labels`` (vLLM's ``engine``
    label: one series per data-parallel replica)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + s.value
    return out


def one_engine_reference(model: str, prompts: Sequence[list[int]], max_tokens: Sequence[int],
                         max_model_len: int) -> list[str]:
    """The same greedy requests on one in-process engine, no parallelism or speculation."""
    from qwenserve import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=max_model_len,
              kv_cache_memory_bytes=16 << 20)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                             for n in max_tokens])
    finally:
        llm.llm_engine.shutdown()
    return [o.outputs[0].text for o in outs]
