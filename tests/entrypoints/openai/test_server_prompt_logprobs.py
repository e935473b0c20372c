"""Prompt logprobs through the server: ``echo`` with ``logprobs`` (what lm-eval's loglikelihood
tasks send to ``/v1/completions``) and vLLM's ``prompt_logprobs`` field, streamed and not."""

from __future__ import annotations

import pytest
from oai_server import SERVED

PROMPT = "The capital of France is Paris."


def _ids(server, text: str) -> list[int]:
    return server.post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_echo_with_logprobs_scores_the_prompt_like_lm_eval(server):
    ids = _ids(server, PROMPT)
    out = server.client().completions.create(
        model=SERVED, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes it
    assert "".join(lp.tokens[: len(ids)]) == PROMPT and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    scored = choice.model_extra["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for k in range(1, len(ids)):
        entry = scored[k][str(ids[k])]  # the prompt's own token is always there
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[k]) and entry["rank"] >= 1
        assert 1 <= len(lp.top_logprobs[k]) <= 2  # logprobs=1: the top one plus the token


def test_prompt_logprobs_agree_with_sampling(server):
    """The score of a token as part of the prompt equals its score when it was generated."""
    client = server.client()
    ids = _ids(server, PROMPT)
    gen = client.completions.create(
        model=SERVED, prompt=ids, max_tokens=1, temperature=0, logprobs=0
    ).choices[0]
    token_logprob = gen.logprobs.token_logprobs[0]
    extended = ids + _ids(server, gen.text) if gen.text else None
    if extended is None or len(extended) != len(ids) + 1:
        pytest.skip("the greedy token does not round-trip through text")
    out = client.completions.create(
        model=SERVED,
        prompt=extended,
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 0},
    ).choices[0]
    last = out.model_extra["prompt_logprobs"][-1][str(extended[-1])]
    assert last["logprob"] == pytest.approx(token_logprob, abs=1e-4) and last["rank"] == 1


def test_streamed_echo_logprobs_match_the_whole_answer(server):
    kwargs = dict(
        model=SERVED, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True, n=2
    )
    client = server.client()
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0]
    tokens: dict[int, list] = {0: [], 1: []}
    logprobs: dict[int, list] = {0: [], 1: []}
    offsets: dict[int, list] = {0: [], 1: []}
    for chunk in client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            tokens[c.index] += c.logprobs.tokens
            logprobs[c.index] += c.logprobs.token_logprobs
            offsets[c.index] += c.logprobs.text_offset
    num_prompt = len(_ids(server, PROMPT))
    for i in (0, 1):
        assert tokens[i] == whole.logprobs.tokens
        # Offsets agree over the echoed prompt and its first answer token; later a stream counts
        # the text it sent, which differs from per-token text on split characters (as vLLM).
        assert offsets[i][: num_prompt + 1] == whole.logprobs.text_offset[: num_prompt + 1]
        assert logprobs[i][0] is None
        assert logprobs[i][1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-4)


def test_chat_prompt_logprobs_cover_the_rendered_prompt(server):
    client = server.client()
    messages = [{"role": "user", "content": "Hello world! How are you today?"}]
    out = client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    scored = out.model_extra["prompt_logprobs"]
    assert len(scored) == out.usage.prompt_tokens and scored[0] is None
    assert all(1 <= len(entry) <= 2 for entry in scored[1:])
    stream = client.chat.completions.create(
        model=SERVED,
        messages=messages,
        max_tokens=2,
        stream=True,
        extra_body={"prompt_logprobs": 1},
    )
    sent = [c.model_extra.get("prompt_logprobs") for c in stream]
    assert sent[0] == scored and not any(sent[1:])  # once, with the role chunk


@pytest.mark.parametrize("value,words", [(21, "max_logprobs"), (-1, "prompt_logprobs")])
def test_prompt_logprobs_out_of_range(server, value, words):
    r = server.post(
        "/v1/completions",
        json={"model": SERVED, "prompt": "Hi", "max_tokens": 2, "prompt_logprobs": value},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    assert words in r.json()["error"]["message"]
