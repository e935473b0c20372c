"""Reasoning and tool-call parsers on fixed texts: whole, and streamed split at every point."""

from __future__ import annotations

import json

import pytest

from qwenserve.entrypoints.openai.reasoning import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)
from qwenserve.entrypoints.openai.tool_parsers import HermesToolParser, merge_deltas

OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"
CLOSED_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"

# (parser, prompt, model output, expected reasoning, expected content)
REASONING_CASES = [
    (
        Qwen3ReasoningParser,
        None,
        "<think>\nLet me think.\n</think>\n\nParis.",
        "\nLet me think.\n",
        "\n\nParis.",
    ),
    (Qwen3ReasoningParser, None, "Paris, no thinking.", None, "Paris, no thinking."),
    (Qwen3ReasoningParser, None, "<thin is not a tag", None, "<thin is not a tag"),
    (Qwen3ReasoningParser, None, "<think>cut off by max_tokens", "cut off by max_tokens", None),
    (Qwen3ReasoningParser, None, "<think></think>", "", None),
    (Qwen3ReasoningParser, OPEN_PROMPT, "step 1 </think>answer", "step 1 ", "answer"),
    (Qwen3ReasoningParser, OPEN_PROMPT, "<think>doubled tag</think>ok", "doubled tag", "ok"),
    (Qwen3ReasoningParser, CLOSED_PROMPT, "Just the answer.", None, "Just the answer."),
    (Qwen3ReasoningParser, None, "a < b and </think> stays", None, "a < b and </think> stays"),
    (
        DeepSeekR1ReasoningParser,
        None,
        "reasoning without a start tag</think>42",
        "reasoning without a start tag",
        "42",
    ),
    (DeepSeekR1ReasoningParser, None, "<think>tagged</think>42", "tagged", "42"),
]


def stream(parser, text: str, cuts: list[int]) -> tuple[str, str]:
    reasoning, content = "", ""
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for i, piece in enumerate(pieces):
        r, c = parser.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("cls,prompt,text,reasoning,content", REASONING_CASES)
def test_reasoning_whole_and_streamed(cls, prompt, text, reasoning, content):
    assert cls(prompt).parse(text) == (reasoning, content)
    for cut in range(1, len(text)):
        assert stream(cls(prompt), text, [cut]) == (reasoning or "", content or "")
    assert stream(cls(prompt), text, list(range(1, len(text)))) == (reasoning or "", content or "")


def test_reasoning_holds_back_only_a_possible_tag():
    parser = Qwen3ReasoningParser()
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>abc</th") == ("abc", "")
    assert parser.feed("ink>") == ("", "")
    assert parser.feed("done") == ("", "done")


CALL_A = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'
CALL_B = '{"name": "get_time", "arguments": {}}'

TOOL_CASES = [
    (
        f"Let me check.<tool_call>\n{CALL_A}\n</tool_call>",
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "°C"})],
    ),
    (
        f"<tool_call>\n{CALL_A}\n</tool_call>\n<tool_call>\n{CALL_B}\n</tool_call>",
        None,
        [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {})],
    ),
    ("No tools needed: 1 < 2.", "No tools needed: 1 < 2.", []),
    (f"<tool_call>\n{CALL_B}", None, [("get_time", {})]),  # unterminated at the end
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
]


def tool_stream(text: str, cuts: list[int]) -> tuple[str, list]:
    parser = HermesToolParser()
    content, calls = "", []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for i, piece in enumerate(pieces):
        c, new = parser.feed(piece, final=i == len(pieces) - 1)
        content, calls = content + c, calls + new
    return content, merge_deltas(calls)


def names_args(calls: list) -> list:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text,content,expected", TOOL_CASES)
def test_tool_calls_whole_and_streamed(text, content, expected):
    got_content, calls = HermesToolParser().parse(text)
    assert got_content == content and names_args(calls) == expected
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    for cuts in [[k] for k in range(1, len(text))] + [list(range(1, len(text)))]:
        streamed_content, streamed_calls = tool_stream(text, cuts)
        assert streamed_content == (content or "")
        assert names_args(streamed_calls) == expected


def test_arguments_are_a_json_string_with_unicode_kept():
    _, calls = HermesToolParser().parse(f"<tool_call>{CALL_A}</tool_call>")
    assert calls[0]["function"]["arguments"] == '{"city": "Paris", "unit": "°C"}'
