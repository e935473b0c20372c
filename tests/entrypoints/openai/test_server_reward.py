"""A reward model (Qwen2.5-Math-RM shape) on ``/pooling`` over HTTP, with vLLM's body and
response: per-token rewards against the plain-PyTorch reference of the checkpoint's own code,
``input`` as text, texts or token ids, ``messages``, base64, ``use_activation``, and the
refusals (other tasks, other routes)."""

from __future__ import annotations

import base64
import math
import struct

import pytest
import torch
from oai_server import RemoteServer

from helpers.tiny_pooling import make_tiny_reward_model, reference_rewards

NAME = "Qwen/Qwen2.5-Math-RM-72B"


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    path = make_tiny_reward_model(str(tmp_path_factory.mktemp("rm") / "qwen2.5-math-rm"))
    srv = RemoteServer([path, "--served-model-name", NAME, "--dtype", "float32",
                        "--max-model-len", "512", "--max-num-batched-tokens", "16",
                        "--kv-cache-memory-bytes", "32M"],
                       tmp_path_factory.mktemp("rm-log") / "server.log")
    yield path, srv
    srv.stop()


def _rows(item: dict) -> torch.Tensor:
    return torch.tensor(item["data"])


def test_pooling_returns_every_tokens_reward(rm):
    path, srv = rm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    texts = ["Hello world! How are you today? I am fine, thank you.", "0123456789"]
    r = srv.post("/pooling", json={"model": NAME, "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == NAME and body["id"].startswith("pooling-")
    ids = [tok.encode(t) for t in texts]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(map(len, ids))
    for i, (item, prompt) in enumerate(zip(body["data"], ids, strict=True)):
        assert item["index"] == i and item["object"] == "pooling"
        torch.testing.assert_close(_rows(item), reference_rewards(path, prompt),
                                   atol=1e-4, rtol=1e-4)
    # token ids, one text, base64 (native order) and use_activation give the same numbers
    one = srv.post("/pooling", json={"input": ids[1]}).json()["data"][0]["data"]
    assert one == srv.post("/pooling", json={"input": texts[1]}).json()["data"][0]["data"]
    torch.testing.assert_close(torch.tensor(one), _rows(body["data"][1]))
    b64 = srv.post("/pooling", json={"input": ids[1], "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["data"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(
        [v for (v,) in one], rel=1e-6)
    act = srv.post("/pooling", json={"input": ids[1], "use_activation": True}).json()
    assert [v for (v,) in act["data"][0]["data"]] == pytest.approx(
        [1 / (1 + math.exp(-v)) for (v,) in one], rel=1e-5)


def test_pooling_renders_messages_with_the_chat_template(rm):
    path, srv = rm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    r = srv.post("/pooling", json={"messages": messages})
    assert r.status_code == 200, r.text
    prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=False),
                        add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)
    torch.testing.assert_close(_rows(r.json()["data"][0]), reference_rewards(path, prompt),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path, body, status, needle", [
    ("/pooling", {"input": "hi", "task": "embed"}, 400, "Unsupported task: 'embed'"),
    ("/pooling", {"input": "hi", "task": "encode"}, 400, "`encode` task was removed"),
    ("/pooling", {"input": "hi", "dimensions": 4}, 400, "dimensions"),
    ("/pooling", {"input": []}, 400, "input must not be empty"),
    ("/pooling", {}, 400, "input or messages"),
    ("/pooling", {"input": [[]]}, 400, "prompt"),
    ("/pooling", {"input": [10**9]}, 400, "out of vocabulary"),
    ("/pooling", {"input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("/pooling", {"input": "hi", "embed_dtype": "bfloat16", "encoding_format": "base64"}, 400,
     "embed_dtype"),
    ("/pooling", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400,
     "image"),
    ("/pooling", {"input": "hi", "encoding_format": "bytes"}, 400, "encoding_format"),
    ("/v1/embeddings", {"input": "hi"}, 400, "reward model"),
    ("/score", {"text_1": "a", "text_2": "b"}, 400, "reward model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, 400, "pooling model"),
])
def test_reward_server_refusals(rm, path, body, status, needle):
    _, srv = rm
    r = srv.post(path, json=body)
    assert r.status_code == status, r.text
    assert needle in r.text
