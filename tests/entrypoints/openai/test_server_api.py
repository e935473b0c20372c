"""The OpenAI surface of a real server, driven by the official ``openai`` client."""

from __future__ import annotations

import asyncio

import pytest
from oai_server import ALIAS, MAX_MODEL_LEN, SERVED

USER = [{"role": "user", "content": "Hello world! How are you today?"}]


def test_open_routes_and_models(server):
    import httpx

    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/health").content == b""
    assert httpx.get(server.base_url + "/version").json()["version"]
    assert httpx.get(server.base_url + "/metrics").status_code == 200  # not guarded
    models = server.client().models.list()
    assert [m.id for m in models.data] == [SERVED, ALIAS]
    card = server.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == MAX_MODEL_LEN and card["object"] == "model"
    assert server.client().models.retrieve(ALIAS).id == ALIAS


def test_completion_greedy_is_deterministic_with_usage(server):
    client = server.client()
    a = client.completions.create(
        model=SERVED,
        prompt="Hello world",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    b = client.completions.create(
        model=ALIAS,
        prompt="Hello world",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert a.choices[0].text == b.choices[0].text and a.choices[0].finish_reason == "length"
    assert a.model == SERVED and b.model == SERVED  # responses carry the first served name
    assert a.usage.completion_tokens == 8 and a.usage.total_tokens == a.usage.prompt_tokens + 8
    assert a.id.startswith("cmpl-") and a.object == "text_completion"


def test_completion_batch_with_n(server):
    out = server.client().completions.create(
        model=SERVED,
        prompt=["The capital of France", "Hello world"],
        n=2,
        max_tokens=5,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 20
    # choice 2p + i is prompt p's child i, which samples with seed 7 + i (vLLM's rule): the
    # same text as that prompt alone with n=1 and that seed, whatever else is in the batch
    texts = {c.index: c.text for c in out.choices}
    for p, prompt in enumerate(["The capital of France", "Hello world"]):
        for i in range(2):
            alone = server.client().completions.create(
                model=SERVED, prompt=prompt, max_tokens=5, temperature=1.0, seed=7 + i,
                extra_body={"ignore_eos": True},
            )
            assert texts[2 * p + i] == alone.choices[0].text != ""
    assert texts[0] != texts[1] and texts[2] != texts[3]


def test_stop_string_cuts_the_text(server):
    client = server.client()
    prompt = "qwenserve serves Qwen models"
    full = (
        client.completions.create(
            model=SERVED,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = full[6:9]
    assert len(stop) == 3
    out = client.completions.create(
        model=SERVED,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert out.text == full[: full.index(stop)] and out.finish_reason == "stop"
    assert out.model_extra["stop_reason"] == stop


def test_completion_logprobs(server):
    out = server.client().completions.create(
        model=SERVED,
        prompt="Hello",
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text


def test_chat_stream_matches_non_stream(server):
    client = server.client()
    kwargs = dict(
        model=SERVED, messages=USER, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert whole.usage.completion_tokens == 12 and whole.object == "chat.completion"


def test_chat_async_stream_with_n(server):
    async def main():
        client = server.async_client()
        stream = await client.chat.completions.create(
            model=SERVED,
            messages=USER,
            max_tokens=6,
            n=2,
            temperature=0.8,
            seed=1,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        roles, finishes, texts = set(), {}, {0: "", 1: ""}
        async for chunk in stream:
            for c in chunk.choices:
                if c.delta.role:
                    roles.add(c.index)
                texts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    finishes[c.index] = c.finish_reason
        return roles, finishes, texts

    roles, finishes, texts = asyncio.run(main())
    assert roles == {0, 1} and finishes == {0: "length", 1: "length"}
    for i in range(2):  # child i samples with seed 1 + i: the text of that request alone
        alone = server.client().chat.completions.create(
            model=SERVED, messages=USER, max_tokens=6, temperature=0.8, seed=1 + i,
            extra_body={"ignore_eos": True},
        )
        assert texts[i] == alone.choices[0].message.content != ""
    assert texts[0] != texts[1]


def test_chat_logprobs(server):
    out = server.client().chat.completions.create(
        model=SERVED,
        messages=USER,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_reasoning_fields_when_the_template_opens_think(server):
    client = server.client()
    kwargs = dict(
        model=SERVED,
        messages=USER,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}},
    )
    msg = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and msg.model_extra["reasoning"] == reasoning and msg.content is None
    streamed = ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        extra = delta.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        streamed += extra.get("reasoning_content") or ""
    assert streamed == reasoning
    plain = client.chat.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True}})
    assert (
        plain.choices[0].message.content
        and plain.choices[0].message.model_extra["reasoning_content"] is None
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_tools_are_rendered_and_tool_history_accepted(server):
    tokens = server.post("/tokenize", json={"messages": USER, "tools": TOOLS}).json()
    prompt = server.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    history = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = server.client().chat.completions.create(
        model=SERVED, messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > tokens["count"]


def test_one_log_line_per_request(server):
    out = server.client().completions.create(model=SERVED, prompt="log me", max_tokens=2)
    lines = [line for line in server.log().splitlines() if f"Request {out.id} " in line]
    assert len(lines) == 1 and "/v1/completions" in lines[0] and "prompt_tokens=" in lines[0]


def test_tokenize_detokenize_roundtrip(server):
    tok = server.post(
        "/tokenize", json={"model": SERVED, "prompt": "Hello world!", "return_token_strs": True}
    ).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    assert tok["max_model_len"] == MAX_MODEL_LEN
    assert server.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {
        "prompt": "Hello world!"
    }


def test_prefix_cache_reset_and_cached_tokens(server):
    client = server.client()
    messages = [{"role": "user", "content": "The capital of France is Paris. " * 6}]
    client.chat.completions.create(model=SERVED, messages=messages, max_tokens=2)
    second = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert server.post("/reset_prefix_cache").status_code == 200
    third = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=2)
    assert third.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", "Basic abc"])
def test_api_key_required_on_v1(server, header):
    import httpx

    headers = {"Authorization": header} if header else {}
    r = httpx.get(server.base_url + "/v1/models", headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == 401
    assert httpx.post(server.base_url + "/tokenize", json={"prompt": "hi"}).status_code == 200
