"""A real server with ``--speculative-config``: greedy output equals the offline engine's
without speculation (streamed and not), and /metrics carries vLLM's spec_decode counters."""

from __future__ import annotations

import json

import pytest
from oai_server import RemoteServer

from qwenserve import LLM, SamplingParams

PROMPT = [7, 300, 12, 7, 300, 12, 7, 300, 12, 7]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


@pytest.fixture(scope="module")
def spec_server(tiny_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("spec_server") / "serve.log"
    srv = RemoteServer([tiny_model_path, "--dtype", "float32", "--max-model-len", "256",
                        "--kv-cache-memory-bytes", "16M", "--speculative-config",
                        json.dumps(SPEC), "--disable-uvicorn-access-log"], log)
    yield srv
    srv.stop()


def test_greedy_equal_streamed_and_metrics(spec_server, tiny_model_path):
    llm = LLM(tiny_model_path, dtype="float32", max_model_len=256)
    expected = llm.generate({"prompt_token_ids": PROMPT},
                            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    client = spec_server.client()
    model = client.models.list().data[0].id
    body = dict(model=model, prompt=PROMPT, max_tokens=32, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**body)
    assert whole.choices[0].text == expected[0].outputs[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True)
                       if c.choices)
    assert streamed == whole.choices[0].text
    metrics = spec_server.get("/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
              for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode") and "position=\"0\"" not in line}
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert values["vllm:spec_decode_num_draft_tokens_total"] >= \
        values["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{" in metrics


@pytest.mark.benchmark
def test_mtp_server_greedy_equal_and_metrics(tiny_model, tmp_path):
    """vLLM Ascend's form, '{"method": "qwen3_5_mtp", "num_speculative_tokens": 3,
    "enforce_eager": true}', on a tiny Qwen3.5 with an MTP head: the same text as the offline
    engine without speculation, streamed too, and the drafts counted in /metrics.

    Under QWENSERVE_RUN_BENCHMARKS=1 (one server start less in CI): MTP through the server is
    test_mtp_server_at_tp2_streams_chat's (streamed, text equal, drafts counted), whole vs
    streamed with speculation test_greedy_equal_streamed_and_metrics', MTP at TP 1 offline
    tests/spec_decode/test_mtp.py's."""
    from helpers.tiny_models import add_mtp_head

    path = add_mtp_head(tiny_model("qwen3_5", mtp_num_hidden_layers=1))
    spec = {"method": "qwen3_5_mtp", "num_speculative_tokens": 3, "enforce_eager": True}
    srv = RemoteServer([path, "--dtype", "float32", "--max-model-len", "256",
                        "--kv-cache-memory-bytes", "16M", "--speculative-config",
                        json.dumps(spec), "--disable-uvicorn-access-log"],
                       tmp_path / "serve.log")
    try:
        llm = LLM(path, dtype="float32", max_model_len=256)
        expected = llm.generate({"prompt_token_ids": PROMPT},
                                SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        client = srv.client()
        body = dict(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=16,
                    temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**body)
        assert whole.choices[0].text == expected[0].outputs[0].text
        streamed = "".join(c.choices[0].text for c in
                           client.completions.create(**body, stream=True) if c.choices)
        assert streamed == whole.choices[0].text
        assert drafts_counted(srv) > 0
    finally:
        srv.stop()


def test_mtp_server_at_tp2_streams_chat(tiny_model, tmp_path):
    """vLLM Ascend's Qwen3.5 form at TP=2: ``--tensor-parallel-size 2 --speculative-config
    '{"method": "qwen3_5_mtp", "num_speculative_tokens": 2}'``; the MTP head runs sharded on
    both ranks. A streamed chat through the official client gives the text of the offline
    engine at TP=1 without speculation, and the drafts are counted."""
    from helpers.tiny_models import add_mtp_head

    path = add_mtp_head(tiny_model("qwen3_5", mtp_num_hidden_layers=1))
    spec = {"method": "qwen3_5_mtp", "num_speculative_tokens": 2}
    messages = [{"role": "user", "content": "Say something about the sea and the sky."}]
    llm = LLM(path, dtype="float32", max_model_len=256)
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    llm.llm_engine.shutdown()
    srv = RemoteServer([path, "--dtype", "float32", "--max-model-len", "256",
                        "--kv-cache-memory-bytes", "16M", "--tensor-parallel-size", "2",
                        "--speculative-config", json.dumps(spec),
                        "--disable-uvicorn-access-log"], tmp_path / "serve.log",
                       env={"OMP_NUM_THREADS": "1"})
    try:
        client = srv.client()
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=messages, max_tokens=24,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(chunks) == expected[0].outputs[0].text
        assert drafts_counted(srv) > 0
    finally:
        srv.stop()


def drafts_counted(srv: RemoteServer) -> float:
    """``vllm:spec_decode_num_drafts_total`` as the server's /metrics reports it (0 if absent)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in srv.get("/metrics").text.splitlines()
              if line.startswith("vllm:spec_decode_num_drafts_total")]
    return values[0] if values else 0.0
