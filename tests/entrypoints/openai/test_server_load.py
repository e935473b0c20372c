"""Concurrency, disconnects and metrics on the shared server."""

from __future__ import annotations

import asyncio
import time

import httpx
from oai_server import MAX_MODEL_LEN, SERVED

from qwenserve import LLM, SamplingParams
from qwenserve.metrics.prometheus import EXPORTED_METRICS

WORDS = [
    "The capital",
    "Hello world",
    "qwenserve serves",
    "def add",
    "numbers, punctuation",
    "How are you",
    "Paris. The",
    "continuous batching",
]
PROMPTS = [f"{WORDS[i % 8]} {i} {WORDS[(i * 3) % 8]}" for i in range(32)]


def test_32_concurrent_streams_equal_offline_greedy(server, tiny_model_path):
    async def one(client, prompt):
        stream = await client.completions.create(
            model=SERVED,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def main():
        client = server.async_client()
        return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    served = asyncio.run(main())
    llm = LLM(
        tiny_model_path,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=32 << 20,
    )
    offline = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [s[0] for s in served] == [o.outputs[0].text for o in offline]
    assert all(s[1] == 16 for s in served)
    chat = server.client().chat.completions.create(
        model=SERVED,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    offline_chat = llm.chat(
        [{"role": "user", "content": PROMPTS[0]}],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    )
    assert chat.choices[0].message.content == offline_chat[0].outputs[0].text


def _abort_count(server) -> float:
    return server.metrics()["vllm:request_success_total{finished_reason=abort}"]


def test_client_disconnect_mid_stream_frees_kv(server):
    before = _abort_count(server)
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hello"}),
    ):
        payload = {"model": SERVED, "max_tokens": 400, "stream": True, "ignore_eos": True, **body}
        with httpx.stream(
            "POST", server.base_url + path, json=payload, headers=server.headers, timeout=30
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
        # leaving the block closed the connection mid-stream
    deadline = time.monotonic() + 10
    while _abort_count(server) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _abort_count(server) == before + 2
    server.wait_idle()


def test_non_streaming_client_timeout_aborts(server):
    before = _abort_count(server)
    payload = {"model": SERVED, "prompt": "Hello", "max_tokens": 450, "ignore_eos": True, "n": 8}
    try:
        server.post("/v1/completions", json=payload, timeout=0.15)
    except httpx.TimeoutException:
        pass
    deadline = time.monotonic() + 10
    while _abort_count(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _abort_count(server) >= before + 1
    server.wait_idle()


def test_metrics_names_and_values_move(server):
    text = server.get("/metrics").text
    for name in EXPORTED_METRICS:
        assert name in text, name
    assert 'model_name="tiny-qwen"' in text and 'engine="0"' in text
    before = server.metrics()
    out = server.client().completions.create(
        model=SERVED,
        prompt="Hello world",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = server.wait_idle()
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 7
    assert (
        after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
        == out.usage.prompt_tokens
    )
    key = "vllm:request_success_total{finished_reason=length}"
    assert after[key] == before[key] + 1
    for hist in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_generation_tokens_count",
    ):
        assert after[hist] == before[hist] + 1, hist
    itl = "vllm:inter_token_latency_seconds_count"
    assert after[itl] == before[itl] + 6
    assert after["vllm:prefix_cache_queries_total"] >= before["vllm:prefix_cache_queries_total"]
    assert "vllm:cache_config_info{block_size=16" in str(list(after))
