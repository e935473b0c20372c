"""The tool-parser seam: model text in, content and OpenAI tool-call deltas out.

A parser is an incremental state machine fed one text delta at a time; a whole response is a
single delta with ``final=True``, so streamed and whole answers never disagree. It returns the
content that is now certain and the tool-call deltas that are now certain, in OpenAI's streamed
form: a call's first delta carries its ``index``, ``id``, ``type`` and ``function.name``, later
deltas carry ``function.arguments`` fragments that concatenate to a JSON object.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

JSONSchema = dict[str, Any]


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call (``DeltaToolCall``)."""

    index: int
    id: str | None = None  # set on the call's first delta, with its name
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        body: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            body["id"], body["type"] = self.id, "function"
            function["name"] = self.name
        function["arguments"] = self.arguments
        body["function"] = function
        return body


def merge_deltas(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """Deltas -> whole OpenAI tool calls (the non-streaming ``message.tool_calls``)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(
            d.index, {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
        )
        if d.id is not None:
            call["id"], call["function"]["name"] = d.id, d.name
        call["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def tool_parameters(tools: list[dict[str, Any]] | None, name: str) -> JSONSchema:
    """The ``properties`` of the named tool's ``parameters`` schema ({} when unknown)."""
    for tool in tools or []:
        function = tool.get("function") or {}
        if function.get("name") == name:
            props = (function.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) else {}
    return {}


class ToolParser:
    """Base of every ``--tool-call-parser``; subclasses implement ``feed``."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """Add content text; returns (content now certain, tool-call deltas now certain)."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole output: (content or None, whole tool calls)."""
        content, deltas = self.feed(text, final=True)
        return content or None, merge_deltas(deltas)

    def _start_call(self, name: str) -> ToolCallDelta:
        self.num_calls += 1
        return ToolCallDelta(self.num_calls - 1, make_tool_call_id(), name)

    def _arguments(self, fragment: str) -> ToolCallDelta:
        return ToolCallDelta(self.num_calls - 1, arguments=fragment)
