"""Structured outputs, tool_choice, qwen3_coder and reasoning controls through a real server and
the openai client. The tiny random-weight model writes anything; only the grammar keeps it valid,
so every check here fails if the constraint is not applied. (Bounded strings use ``pattern``:
xgrammar's ``maxLength`` rule lets raw control characters into strings, which strict JSON
parsers refuse.)

One server for the module: Qwen3.5-style template (it opens <think> unless enable_thinking is
false), ``--tool-call-parser qwen3_coder``, ``--reasoning-parser qwen3``, compact JSON.
"""

from __future__ import annotations

import json
import re

import jsonschema_rs
import openai
import pytest
from oai_server import DATA, MAX_MODEL_LEN, SERVED, RemoteServer

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MSG = [{"role": "user", "content": "Hello world! How are you today?"}]

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                "required": ["name", "age"],
            },
        },
        "required": ["user"],
    },
    "array": {
        "type": "object",
        "properties": {"scores": {"type": "array",
                                  "items": {"type": "number", "minimum": -1e3, "maximum": 1e3},
                                  "minItems": 1, "maxItems": 4}},
        "required": ["scores"],
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
    },
    "required_and_optional": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                       "note": {"type": "string", "pattern": "^[a-z]{1,5}$"}},
        "required": ["id", "tag"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {"type": "object", "properties": {"k": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                                                    "v": {"type": "integer"}},
                  "required": ["k", "v"]},
        "minItems": 1,
        "maxItems": 3,
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,10}$"},
                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                           "required": ["zone"]},
        },
    },
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def agent_server(tiny_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("agent_server") / "serve.log"
    srv = RemoteServer(
        [
            tiny_model_path, "--served-model-name", SERVED, "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", "64M",
            "--chat-template", str(DATA / "qwen3_5_tools.jinja"),
            "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
            "--tool-call-parser", "qwen3_coder",
            "--structured-outputs-config.disable_any_whitespace", "true",
            "--disable-uvicorn-access-log",
        ],
        log,
    )
    yield srv
    srv.stop()


def chat(server, **kwargs):
    extra = {**NO_THINKING, **kwargs.pop("extra_body", {})}
    kwargs.setdefault("max_tokens", 200)
    return server.client().chat.completions.create(
        model=SERVED, messages=MSG, temperature=0.8, extra_body=extra, **kwargs)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(agent_server, name):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    out = chat(agent_server, response_format=fmt, n=2)
    for choice in out.choices:
        text = choice.message.content
        assert choice.finish_reason == "stop", text
        jsonschema_rs.validate(schema, json.loads(text)), text


def test_structured_outputs_regex_choice_grammar_json_object(agent_server):
    out = chat(agent_server, extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,5}-\d{3}"}})
    assert re.fullmatch(r"[A-Z][a-z]{2,5}-\d{3}", out.choices[0].message.content)
    out = chat(agent_server, n=4, extra_body={"structured_outputs": {"choice": ["yes", "no", "I"
                                                                               " don't know"]}})
    assert {c.message.content for c in out.choices} <= {"yes", "no", "I don't know"}
    grammar = 'root ::= "(" expr ")"\nexpr ::= num (("+" | "*") num)*\nnum ::= [1-9] [0-9]?'
    out = chat(agent_server, extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"\(\d{1,2}([+*]\d{1,2})*\)", out.choices[0].message.content)
    out = chat(agent_server, response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_completions_and_streaming_are_constrained(agent_server):
    schema = SCHEMAS["enum"]
    out = agent_server.client().completions.create(
        model=SERVED, prompt="Colors:", max_tokens=100, temperature=1.0,
        extra_body={"structured_outputs": {"json": schema}})
    jsonschema_rs.validate(schema, json.loads(out.choices[0].text))
    stream = agent_server.client().chat.completions.create(
        model=SERVED, messages=MSG, max_tokens=100, temperature=1.0, stream=True, n=2,
        extra_body={**NO_THINKING, "structured_outputs": {"json": schema}})
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts:
        jsonschema_rs.validate(schema, json.loads(text))


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(agent_server, stream):
    def calls_of(**kwargs):
        kwargs.setdefault("tool_choice", "required")
        if not stream:
            out = chat(agent_server, tools=TOOLS, **kwargs)
            return out.choices[0].finish_reason, out.choices[0].message.tool_calls
        calls: dict[int, dict] = {}
        finish = None
        for chunk in chat(agent_server, tools=TOOLS, stream=True, **kwargs):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"name": None, "arguments": ""})
                    call["name"] = d.function.name or call["name"]
                    call["arguments"] += d.function.arguments or ""
        return finish, [openai.types.chat.ChatCompletionMessageToolCall(
            id="x", type="function", function=c) for c in calls.values()]

    finish, calls = calls_of(parallel_tool_calls=False)
    assert finish == "tool_calls" and len(calls) == 1
    for call in calls:
        jsonschema_rs.validate(TOOL_SCHEMAS[call.function.name],
                               json.loads(call.function.arguments))
    named = {"type": "function", "function": {"name": "get_time"}}
    finish, calls = calls_of(tool_choice=named)
    assert finish == "stop" and [c.function.name for c in calls] == ["get_time"]
    jsonschema_rs.validate(TOOL_SCHEMAS["get_time"], json.loads(calls[0].function.arguments))


QWEN3_CODER_CALL = (
    'root ::= "Checking.\\n\\n<tool_call>\\n<function=get_weather>\\n<parameter=city>\\n" city '
    '"\\n</parameter>\\n<parameter=days>\\n" [1-7] "\\n</parameter>\\n</function>\\n</tool_call>"'
    '\ncity ::= "Paris" | "Berlin"'
)


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_coder_calls_end_to_end(agent_server, stream):
    """The grammar makes the model write Qwen3.5's XML call; the qwen3_coder parser turns it
    into an OpenAI tool call with ``days`` as an integer (its schema's type)."""
    kwargs = dict(tools=TOOLS, tool_choice="auto",
                  extra_body={"structured_outputs": {"grammar": QWEN3_CODER_CALL}})
    if not stream:
        out = chat(agent_server, **kwargs)
        message = out.choices[0].message
        content, calls = message.content, message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls"
        name, args = calls[0].function.name, json.loads(calls[0].function.arguments)
    else:
        content, name, arguments, ids = "", None, "", set()
        for chunk in chat(agent_server, stream=True, **kwargs):
            for c in chunk.choices:
                content += c.delta.content or ""
                for d in c.delta.tool_calls or []:
                    name = d.function.name or name
                    arguments += d.function.arguments or ""
                    ids |= {d.id} if d.id else set()
        assert len(ids) == 1
        args = json.loads(arguments)
    assert content == "Checking." and name == "get_weather"
    assert args["city"] in ("Paris", "Berlin") and isinstance(args["days"], int)


def test_reasoning_gate_and_thinking_budget(agent_server):
    """Thinking on: the constraint waits for </think>; the budget forces it after 6 tokens."""
    schema = SCHEMAS["enum"]
    out = chat(agent_server, extra_body={"chat_template_kwargs": {"enable_thinking": True},
                                         "thinking_token_budget": 6,
                                         "structured_outputs": {"json": schema}})
    message = out.choices[0].message
    assert message.reasoning is not None
    jsonschema_rs.validate(schema, json.loads(message.content))
    out = chat(agent_server, max_tokens=40,
               extra_body={"chat_template_kwargs": {"enable_thinking": True},
                           "thinking_token_budget": 0})
    assert out.choices[0].message.reasoning == ""  # </think> forced at once


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"structured_outputs": {"regex": "("}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"json": {"type": 3}}}, "structured_outputs", "json"),
        ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs", "nope"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "exactly one"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "Extra inputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", "schema"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs", "give only one"),
        ({"thinking_token_budget": -1}, "thinking_token_budget", "greater than or equal"),
    ],
)
def test_bad_constraints_are_400(agent_server, body, param, words):
    r = agent_server.post("/v1/chat/completions",
                          json={"model": SERVED, "messages": MSG, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
