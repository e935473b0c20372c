"""Prefill/decode disaggregation end to end: two real servers and the proxy on 127.0.0.1.

Greedy output through P/D equals the decode server's own single-server output (it prefills
itself when no kv_transfer_params come), streamed and not; the producer frees its blocks once
pulled; a consumer whose producer is gone answers a clear error within the pull timeout."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

PROMPT = [7, 300, 12, 45, 99, 100, 5, 17, 23, 8, 64, 77, 300, 12, 7, 3, 150, 151, 9]


def _completion(base_url: str, **extra) -> httpx.Response:
    body = {"model": "any", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, **extra}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=60)


def _model(server) -> str:
    return server.client().models.list().data[0].id


def test_producer_holds_then_consumer_pulls(producer, consumer):
    model = _model(producer)
    single = consumer.client().completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                                  temperature=0, extra_body={"ignore_eos": True})
    pre = _completion(producer.base_url, model=model, max_tokens=1,
                      kv_transfer_params={"do_remote_decode": True})
    assert pre.status_code == 200, pre.text
    kv = pre.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_engine_id"] == "prefill-0"
    assert kv["remote_host"] == "127.0.0.1" and kv["remote_num_tokens"] == len(PROMPT)
    assert len(kv["remote_block_ids"]) == -(-len(PROMPT) // kv["remote_block_size"])
    assert producer.metrics()["vllm:kv_cache_usage_perc"] > 0  # held for the consumer
    out = _completion(consumer.base_url, model=model, kv_transfer_params=kv)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == single.choices[0].text
    assert out.json()["usage"]["prompt_tokens"] == len(PROMPT)
    producer.wait_idle(timeout_s=5)  # pulled: the producer's blocks are free again
    consumer.wait_idle(timeout_s=5)


def test_proxy_equals_single_server(proxy, consumer):
    model = _model(consumer)
    body = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True})
    single = consumer.client().completions.create(**body).choices[0].text
    via_proxy = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0)
    assert via_proxy.completions.create(**body).choices[0].text == single
    streamed = "".join(c.choices[0].text for c in via_proxy.completions.create(**body,
                                                                                 stream=True)
                       if c.choices)
    assert streamed == single
    messages = [{"role": "user", "content": "Tell me about disaggregated serving."}]
    chat_single = consumer.client().chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0)
    chat_proxy = via_proxy.chat.completions.create(model=model, messages=messages,
                                                   max_tokens=10, temperature=0)
    assert chat_proxy.choices[0].message.content == chat_single.choices[0].message.content


def test_producer_gone_fails_clearly(consumer):
    dead = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_host": "127.0.0.1",
            "remote_port": 9, "remote_block_ids": [1, 2], "remote_request_id": "cmpl-x-0",
            "tp_size": 1}
    start = time.monotonic()
    out = _completion(consumer.base_url, model=_model(consumer), kv_transfer_params=dead)
    assert out.status_code == 503, out.text
    assert "KV transfer failed" in out.json()["error"]["message"]
    assert "no answer from the producer" in out.json()["error"]["message"]
    assert time.monotonic() - start < 20
    consumer.wait_idle(timeout_s=5)  # its blocks went back
    assert _completion(consumer.base_url, model=_model(consumer)).status_code == 200


@pytest.mark.parametrize("params, needle", [
    ({"do_remote_prefill": True}, "needs ['remote_engine_id'"),
    ({"do_remote_decode": True}, "this server is a kv_consumer"),
    ({"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "h",
      "remote_port": 1, "remote_block_ids": [0, 1], "remote_request_id": "r",
      "remote_block_size": 32}, "same --block-size"),
])
def test_bad_params_are_refused_by_name(consumer, params, needle):
    out = _completion(consumer.base_url, model=_model(consumer), kv_transfer_params=params)
    assert out.status_code in (400, 503), out.text
    assert needle in out.json()["error"]["message"]
