"""Bad input gets an OpenAI error envelope with the right status and ``param``; the engine keeps
serving and leaks no KV blocks."""

from __future__ import annotations

import httpx
import openai
import pytest
from oai_server import MAX_MODEL_LEN, SERVED

MSG = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# (endpoint, body, status, param, words in the message)
CASES = [
    (
        CHAT,
        {"messages": MSG, "max_tokens": MAX_MODEL_LEN},
        400,
        "input_tokens",
        [f"maximum context length is {MAX_MODEL_LEN} tokens", f"requested {MAX_MODEL_LEN} output"],
    ),
    (
        COMPLETIONS,
        {"prompt": [3 + i % 400 for i in range(MAX_MODEL_LEN)]},
        400,
        "input_tokens",
        [f"maximum context length is {MAX_MODEL_LEN} tokens", f"{MAX_MODEL_LEN} input tokens"],
    ),
    (CHAT, {"messages": MSG, "temperature": -1}, 400, "temperature", ["temperature"]),
    (CHAT, {"messages": MSG, "top_p": 2}, 400, "top_p", ["top_p"]),
    (CHAT, {"messages": MSG, "n": 0}, 400, "n", []),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", ["max_tokens"]),
    (CHAT, {"messages": MSG, "presence_penalty": 3}, 400, "presence_penalty", []),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "logprobs", []),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", []),
    (
        CHAT,
        {"messages": MSG, "logprobs": True, "top_logprobs": -1},
        400,
        "top_logprobs",
        ["positive"],
    ),
    (CHAT, {"messages": MSG, "max_tokens": "many"}, 400, "max_tokens", []),
    (CHAT, {"messages": "hello"}, 400, "messages", []),
    (CHAT, {"messages": []}, 400, "messages", ["at least one message"]),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", []),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages.0.content.0",  # the malformed part itself
        ["image_url", "URL"],
    ),
    (
        CHAT,
        {"messages": MSG, "chat_template_kwargs": {"raise_error": True}},
        400,
        "messages",
        ["chat template failed"],
    ),
    (
        CHAT,
        {"messages": MSG, "chat_template": "{{ messages }}"},
        400,
        "chat_template",
        ["--trust-request-chat-template"],
    ),
    (
        CHAT,
        {"messages": MSG, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        ["stream=True"],
    ),
    (
        CHAT,
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
        ["'g', which is not among the tools (f)"],
    ),
    (CHAT, {"messages": MSG, "logit_bias": {"5": 101}}, 400, "logit_bias", ["[-100, 100]"]),
    (CHAT, {"messages": MSG, "logit_bias": {"x": 1}}, 400, "logit_bias", ["token ids"]),
    (CHAT, {"messages": MSG, "logit_bias": {"100000": 1}}, 400, "logit_bias", ["vocabulary"]),
    (CHAT, {"messages": MSG, "guided_json": {}}, 400, "guided_json", ["structured_outputs"]),
    (CHAT, {"model": "nope", "messages": MSG}, 404, "model", ["The model `nope` does not exist."]),
    (COMPLETIONS, {"prompt": [10**6]}, 400, "prompt", ["out of vocabulary"]),
    (COMPLETIONS, {"prompt": "Hi", "suffix": "x"}, 400, "suffix", []),
    (COMPLETIONS, {"prompt": []}, 400, "prompt", []),
    (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [-1]}, 400, "stop_token_ids", []),
    (COMPLETIONS, {"prompt": "Hi", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens", []),
    (COMPLETIONS, {"prompt": "Hi", "temperature": "NaN"}, 400, "temperature", []),
    # /tokenize's body is a union of two forms: param names the field, not a class.
    ("/tokenize", {}, 400, "prompt", ["Field required"]),
]


@pytest.mark.parametrize(
    "path,body,status,param,words",
    CASES,
    ids=[f"{c[0].split('/')[-1]}-{c[3]}-{i}" for i, c in enumerate(CASES)],
)
def test_bad_request(server, path, body, status, param, words):
    for stream in (False, True):
        if stream and "stream_options" in body:
            continue
        r = server.post(path, json={"model": SERVED, **body, "stream": stream})
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["code"] == status and error["param"] == param, error
        assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
        for word in words:
            assert word in error["message"]


def test_malformed_json_and_wrong_content(server):
    r = server.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "Invalid JSON" in r.json()["error"]["message"]
    r = server.post(CHAT, content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert server.get("/v1/nothing-here").status_code == 404
    assert server.get("/v1/nothing-here").json()["error"]["code"] == 404


def test_body_over_the_limit_is_413(server):
    big = "x" * (300 << 10)
    r = server.post(CHAT, json={"messages": [{"role": "user", "content": big}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunks():
        for _ in range(40):
            yield b"x" * (10 << 10)

    r = server.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_openai_client_raises_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SERVED, messages=MSG, max_tokens=10_000)
    assert "maximum context length" in str(e.value)
    bad_key = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_engine_still_serves_and_no_blocks_leak_after_errors(server):
    for _ in range(3):
        server.post(CHAT, json={"messages": MSG, "max_tokens": 10_000})
        server.post(COMPLETIONS, json={"prompt": [10**6], "stream": True})
    out = server.client().chat.completions.create(model=SERVED, messages=MSG, max_tokens=3)
    assert out.usage.completion_tokens <= 3
    server.wait_idle()
    assert httpx.get(server.base_url + "/health").status_code == 200
