"""The qwen3_coder tool parser on the exact bytes the Qwen3.5 and Qwen3-Coder chat templates write
(tests/entrypoints/openai/data/*.jinja): rendered assistant turns are cut where generation starts,
parsed whole and streamed split at every point, and must give back the calls they were made from,
with each argument in the type its schema declares."""

from __future__ import annotations

import json

import pytest
from oai_server import DATA

from qwenserve.entrypoints.openai.reasoning import Qwen3ReasoningParser
from qwenserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, Qwen3CoderToolParser
from qwenserve.entrypoints.openai.tool_parsers.base import merge_deltas

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "celsius": {"type": "boolean"},
                    "threshold": {"type": "number"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                    "where": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                    "unit": {"enum": ["C", "F"]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}},
]
ARGS_A = {
    "city": "Paris <Île-de-France>",
    "days": 3,
    "celsius": True,
    "threshold": 0.5,
    "hours": [9, 12],
    "where": {"lat": 48.8, "tags": ["x"]},
    "note": None,
    "unit": "C",
}
ARGS_B = {"path": "a.py", "content": "def f():\n    return '\"ok\"'\n\n"}


def render(template: str, message: dict, generation_prompt: str) -> str:
    """The model's output for ``message``: its rendered turn after the generation prompt."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    text = env.from_string((DATA / template).read_text()).render(messages=[message])
    assert text.startswith(generation_prompt) and text.endswith("<|im_end|>\n")
    return text[len(generation_prompt) : -len("<|im_end|>\n")]


def call(name: str, args: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


TURNS = [
    ("Let me check the weather.", [call("get_weather", ARGS_A)]),
    ("", [call("get_weather", ARGS_A), call("write_file", ARGS_B)]),
    ("Two files.", [call("write_file", ARGS_B), call("write_file", {"path": "b"})]),
    ("No tools needed: 1 < 2 and <b>bold</b>.", []),
    ("", [call("get_weather", {})]),
]


def stream_parse(parser, text: str, cuts: list[int]) -> tuple[str, list]:
    content, deltas = "", []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for i, piece in enumerate(pieces):
        c, d = parser.feed(piece, final=i == len(pieces) - 1)
        content, deltas = content + c, deltas + d
    return content, merge_deltas(deltas)


def check(text: str, content: str, calls: list[dict]) -> None:
    """Parsed whole and streamed: ``content`` and ``calls`` (without calls, text is untouched)."""
    content = content if calls else text
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    got_content, got = Qwen3CoderToolParser(TOOLS).parse(text)
    assert (got_content or "") == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == expected
    for cuts in [[k] for k in range(1, len(text))] + [list(range(1, len(text)))]:
        streamed_content, streamed = stream_parse(Qwen3CoderToolParser(TOOLS), text, cuts)
        assert streamed_content == content, cuts
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in got
        ], cuts


@pytest.mark.parametrize("content,calls", TURNS)
def test_qwen3_coder_template_bytes(content, calls):
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    text = render("qwen3_coder_tools.jinja", message, "<|im_start|>assistant\n")
    if calls:
        assert "<parameter=" in text or not calls[0]["function"]["arguments"]
    check(text, content, calls)


@pytest.mark.parametrize("content,calls", TURNS)
def test_qwen3_5_template_bytes_after_reasoning(content, calls):
    """Qwen3.5 opens <think> in the prompt: the output is reasoning</think>content+calls."""
    prompt_end = "<|im_start|>assistant\n<think>\n"
    message = {
        "role": "assistant",
        "content": content,
        "reasoning_content": "The user wants\nthe weather.",
        "tool_calls": calls,
    }
    output = render("qwen3_5_tools.jinja", message, prompt_end)
    reasoning, after = Qwen3ReasoningParser(prompt_end).parse(output)
    assert reasoning == "The user wants\nthe weather.\n"
    # The template's blank line after </think> stays content (as vLLM's qwen3 parser leaves it).
    check(after or "", "\n\n" + content if content else "", calls)


def test_streamed_string_arguments_arrive_before_the_value_ends():
    parser = Qwen3CoderToolParser(TOOLS)
    _, deltas = parser.feed("<tool_call>\n<function=write_file>\n<parameter=content>\nline one\n")
    assert deltas[0].name == "write_file" and deltas[0].id.startswith("chatcmpl-tool-")
    assert "".join(d.arguments for d in deltas) == '{"content": "line one'  # newline held back
    _, deltas = parser.feed("</parameter>\n</function>\n</tool_call>", final=True)
    assert "".join(d.arguments for d in deltas) == '"}'


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>",  # hermes JSON, not XML
        "<tool_call>\n<function=get weather\nbroken",  # header never closed
        "<tool_call>",  # cut off right after the tag
        "<tool_call>\n<function=",
    ],
)
def test_malformed_calls_stay_content(text):
    assert check(text, text, []) is None


def test_cut_off_call_is_closed_with_what_it_has():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    content, calls = Qwen3CoderToolParser(TOOLS).parse(text)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Par"}


def test_values_that_do_not_fit_the_schema_stay_strings():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
        "<parameter=celsius>\nyes\n</parameter>\n<parameter=extra>\n7\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    _, calls = Qwen3CoderToolParser(TOOLS).parse(text)
    args = json.loads(calls[0]["function"]["arguments"])
    assert args == {"days": "three", "celsius": "yes", "extra": "7"}


def test_registry_names_and_aliases():
    assert TOOL_PARSERS["qwen3_coder"] is TOOL_PARSERS["qwen3_xml"] is Qwen3CoderToolParser
    assert "hermes" in TOOL_PARSERS
