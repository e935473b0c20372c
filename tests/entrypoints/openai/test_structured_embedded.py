"""The issue's acceptance run on the embedded SmolLM2-135M-Instruct through a real server:
five JSON schemas validate in 20 of 20 tries each at temperature 0.8, and so do a regex, a
choice list, a small EBNF grammar and a ``tool_choice: "required"`` call. Benchmark-sized
(QWENSERVE_RUN_BENCHMARKS=1); CI runs the same checks on the tiny model in
test_server_structured.py.
"""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest
from oai_server import RemoteServer
from test_server_structured import SCHEMAS, TOOL_SCHEMAS, TOOLS

TRIES = 20
ASK = {
    "nested": "Describe a user with a name and an age as JSON.",
    "array": "Give a few test scores as JSON.",
    "enum": "Pick a color and say whether it is ok, as JSON.",
    "required_and_optional": "Give an id and a short tag as JSON.",
    "array_of_objects": "List key/value pairs as JSON.",
}

pytestmark = pytest.mark.benchmark


@pytest.fixture(scope="module")
def embedded_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("embedded_structured") / "serve.log"
    srv = RemoteServer(["--max-model-len", "2048", "--disable-uvicorn-access-log",
                        "--max-num-seqs", str(TRIES)], log)
    yield srv
    srv.stop()


def ask(server, content: str, **kwargs):
    client = server.client().with_options(timeout=900)  # n=20 on a shared 2-core CPU
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], temperature=0.8,
        max_tokens=400, n=TRIES, **kwargs)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_five_schemas_twenty_of_twenty(embedded_server, name):
    schema = SCHEMAS[name]
    out = ask(embedded_server, ASK[name], response_format={
        "type": "json_schema", "json_schema": {"name": name, "schema": schema}})
    assert len(out.choices) == TRIES
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema_rs.validate(schema, json.loads(choice.message.content))


def test_regex_choice_grammar_and_required_tool(embedded_server):
    pattern = r"\d{3}-\d{3}-\d{4}"
    out = ask(embedded_server, "Give me a phone number.",
              extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.message.content) for c in out.choices)
    options = ["Paris", "Berlin", "Rome"]
    out = ask(embedded_server, "What is the capital of France?",
              extra_body={"structured_outputs": {"choice": options}})
    assert all(c.message.content in options for c in out.choices)
    grammar = 'root ::= "The answer is " num "."\nnum ::= [0-9] | [1-9] [0-9]'
    out = ask(embedded_server, "What is 6 times 7?",
              extra_body={"structured_outputs": {"grammar": grammar}})
    assert all(re.fullmatch(r"The answer is \d{1,2}\.", c.message.content) for c in out.choices)
    out = ask(embedded_server, "What is the weather in Paris for the next 3 days?",
              tools=TOOLS, tool_choice="required")
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema_rs.validate(TOOL_SCHEMAS[call.function.name],
                                   json.loads(call.function.arguments))
