"""MTP speculative decoding with data parallelism, on real processes: a tiny Qwen3.5-MoE with an
``mtp.*`` head (hybrid: its Gated DeltaNet states roll back on rejected drafts) served with
``--data-parallel-size 2 --enable-expert-parallel --speculative-config qwen3_5_mtp`` as vLLM
Ascend's guides run it (also with ``--tensor-parallel-size 2``), and with plain
``--data-parallel-size 2``.

With DP x EP the replicas form one MoE group, the MTP head's MoE layer included, so every replica
must run the same MoE passes each step: target, rollback recompute, k head passes
(``worker/dp_passes.py``). The loads here are unequal on purpose (different lengths, one replica
idle while the other drafts and rolls back): a replica running a pass the other skips would hang
in the collective, which the requests' timeouts turn into a failure. Greedy output must equal one
engine's without speculation."""

from __future__ import annotations

import json
import signal
import threading

import pytest
from oai_server import RemoteServer

from helpers.tiny_models import add_mtp_head

# disable_by_batch_size 2: a replica with 2 requests drafts nothing while one with 1 drafts, so
# the replicas' speculation on/off decisions can differ in a step (none is agreed)
SPEC = {"method": "qwen3_5_mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 2}
ARGS = ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory-bytes", "16M",
        "--max-num-batched-tokens", "32", "--data-parallel-size", "2",
        "--speculative-config", json.dumps(SPEC)]
PROMPTS = [[5, 17, 99, 3], list(range(10, 50)), [7, 300, 12, 7, 300, 12], [42] * 9]
MAX_TOKENS = [14, 3, 9, 1]  # replicas finish at different steps: one idles, one drafts


@pytest.fixture(scope="module")
def moe_mtp_path(tiny_model) -> str:
    return add_mtp_head(tiny_model("qwen3_5_moe", mtp_num_hidden_layers=1))


@pytest.fixture(scope="module")
def reference(moe_mtp_path) -> list[str]:
    """One engine, no speculation: the prompts, then PROMPTS[0] again alone (6 tokens)."""
    from qwenserve import LLM, SamplingParams

    llm = LLM(moe_mtp_path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in [*PROMPTS, PROMPTS[0]]],
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                         for n in [*MAX_TOKENS, 6]])
    llm.llm_engine.shutdown()
    return [o.outputs[0].text for o in outs]


def _complete(server: RemoteServer, prompt: list[int], max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = server.post("/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _served(server: RemoteServer) -> list[str]:
    """The prompts at once (both replicas busy, then one), then one request alone."""
    got = [""] * len(PROMPTS)

    def one(i: int) -> None:
        got[i] = _complete(server, PROMPTS[i], MAX_TOKENS[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert not any(t.is_alive() for t in threads), "a request hung: the replicas' passes " \
        "diverged\n" + server.log()[-3000:]
    return [*got, _complete(server, PROMPTS[0], 6)]  # alone: the other replica idles


def _per_engine(server: RemoteServer, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + s.value
    return out


@pytest.mark.parametrize("extra", [["--enable-expert-parallel"], [],
                                   ["--enable-expert-parallel", "--tensor-parallel-size", "2"]],
                         ids=["dp_ep", "dp", "dp_ep_tp2"])
def test_mtp_with_data_parallelism_equals_one_engine(moe_mtp_path, reference, tmp_path, extra):
    """dp_ep_tp2: 2 replicas x 2 tensor-parallel ranks, the head sharded on both ranks of each
    replica, its experts over all 4."""
    flags = [*ARGS, *extra]
    server = RemoteServer([moe_mtp_path, *flags], tmp_path / "serve.log",
                          env={"QWENSERVE_SERVER_DEV_MODE": "1"})
    try:
        assert _served(server) == reference
        done = _per_engine(server, "vllm:request_success_total")
        drafts = _per_engine(server, "vllm:spec_decode_num_drafts_total")
        assert set(done) == {"0", "1"} and all(done.values()), done  # both replicas served
        assert sum(drafts.values()) > 0, drafts
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()[-3000:]
