"""Every vLLM request field is honoured or refused by name (request_fields.FIELDS), and
docs/serving.md lists each one. Honoured fields are sent with a non-default value and must give
200; refused ones with a non-default value must give a 400 whose ``param`` names them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from oai_server import SERVED

from qwenserve.entrypoints.openai.request_fields import FIELDS, REMOVED_FIELDS

MSG = [{"role": "user", "content": "Hello world! How are you today?"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
DOCS = Path(__file__).resolve().parents[3] / "docs" / "serving.md"

# field -> the body that sets it to something other than its default (beside the base body)
HONOURED = {
    "model": {"model": SERVED},
    "messages": {},
    "mm_processor_kwargs": {"mm_processor_kwargs": {"max_pixels": 4096}},  # no images: nothing to do
    "prompt": {"prompt": [5, 6, 7]},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "presence_penalty": {"presence_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "logit_bias": {"logit_bias": {"5": 3.0}},
    "logprobs": {"chat": {"logprobs": True}, "completion": {"logprobs": 2}},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "max_tokens": {"max_tokens": 3},
    "max_completion_tokens": {"max_completion_tokens": 3},
    "min_tokens": {"min_tokens": 1},
    "n": {"n": 2},
    "seed": {"seed": 7},
    "stop": {"stop": ["xyz"]},
    "stop_token_ids": {"stop_token_ids": [5]},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "ignore_eos": {"ignore_eos": True},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.1},
    "skip_special_tokens": {"skip_special_tokens": False},
    "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "echo": {"echo": True},
    "user": {"user": "someone"},
    "add_special_tokens": {"chat": {"add_special_tokens": True},
                           "completion": {"add_special_tokens": False}},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 3},
    "truncation_side": {"truncate_prompt_tokens": 3, "truncation_side": "right"},
    "allowed_token_ids": {"allowed_token_ids": [5, 6]},
    "bad_words": {"bad_words": ["Hello"]},
    "response_format": {"response_format": {"type": "json_object"}},
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
    "thinking_token_budget": {"thinking_token_budget": 2},
    "request_id": {"request_id": "my-id"},
    "kv_transfer_params": {"kv_transfer_params": {"do_remote_decode": True}},
    "tools": {"tools": TOOLS, "tool_choice": "none"},
    "tool_choice": {"tools": TOOLS, "tool_choice": "auto"},
    "parallel_tool_calls": {"tools": TOOLS, "parallel_tool_calls": False},
    "reasoning_effort": {"reasoning_effort": "low"},
    "include_reasoning": {"include_reasoning": False},
    "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {"add_generation_prompt": False, "continue_final_message": True,
                               "messages": [*MSG, {"role": "assistant", "content": "Fine"}]},
    "documents": {"documents": [{"title": "t", "text": "x"}]},
    "chat_template": {"chat_template": "{{ messages[0].content }}"},  # needs the trust flag
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": True}},
}
# honoured only with --trust-request-chat-template / --kv-transfer-config (tests/kv_transfer)
NEEDS_FLAG = {"chat_template", "kv_transfer_params"}
REFUSED_VALUE = {"length_penalty": 2.0, "echo": True, "priority": 1, "stream_interval": 2}


def cases():
    for field in FIELDS:
        for endpoint in field.endpoints:
            yield pytest.param(field, endpoint, id=f"{endpoint}-{field.name}")


@pytest.mark.parametrize("field,endpoint", cases())
def test_field_is_honoured_or_refused_by_name(server, field, endpoint):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = {"model": SERVED, "max_tokens": 2, "temperature": 0}
    body |= {"messages": MSG} if endpoint == "chat" else {"prompt": "Hello world"}
    if field.honoured:
        extra = HONOURED[field.name]
        body |= extra.get(endpoint, extra) if endpoint in extra else extra
    else:
        body[field.name] = REFUSED_VALUE.get(field.name, True if field.default is False else
                                             {"x": 1})
    r = server.post(path, json=body)
    if field.honoured and field.name not in NEEDS_FLAG:
        assert r.status_code == 200, (field.name, r.text)
    else:
        assert r.status_code == 400, (field.name, r.text)
        assert r.json()["error"]["param"] == field.name, r.text


def test_removed_guided_fields_name_their_replacement(server):
    for name, replacement in REMOVED_FIELDS.items():
        r = server.post("/v1/completions", json={"model": SERVED, "prompt": "Hi", name: "x"})
        assert r.status_code == 400 and replacement in r.json()["error"]["message"], r.text


def test_docs_list_every_field():
    text = DOCS.read_text()
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", text, flags=re.M))
    missing = {f.name for f in FIELDS} - listed
    assert not missing, f"docs/serving.md does not list {sorted(missing)}"
