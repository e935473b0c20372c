"""Hermes tool calls, the format of Qwen2.5/Qwen3/QwQ chat templates:

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

becomes ``content="Let me check."`` and one OpenAI tool call whose ``arguments`` is a JSON string.

As the reasoning parser, one incremental state machine serves streaming and whole responses:

    TEXT --"<tool_call>"--> CALL --"</tool_call>"--> AFTER --"<tool_call>"--> CALL ...

Text before the first call is content (a possible partial ``<tool_call>`` at a delta's end is
held back). A call is emitted when its closing tag arrives (or the output ends): its name, then
its arguments, which OpenAI clients accumulate like vLLM's finer fragments.
Text between and after calls is dropped, as vLLM's non-streaming parser does. A call whose body is
not a JSON object with a ``name`` goes out verbatim as content instead.
"""

from __future__ import annotations

import json

from qwenserve.entrypoints.openai.reasoning.qwen3 import partial_suffix_len
from qwenserve.entrypoints.openai.tool_parsers.base import ToolCallDelta, ToolParser

_TEXT, _CALL, _AFTER = "text", "call", "after"


def parse_call(body: str) -> tuple[str, str] | None:
    """``{"name": ..., "arguments": {...}}`` -> (name, arguments JSON), or None if malformed."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return obj["name"], arguments


class HermesToolParser(ToolParser):
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._state = _TEXT
        self._buf = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self._buf += delta
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._step(content, calls, final):
            pass
        return "".join(content), calls

    def _step(self, content: list[str], calls: list[ToolCallDelta], final: bool) -> bool:
        """Consume what the buffer settles; returns True to go on, False to wait for text."""
        if self._state == _CALL:
            return self._take_call(content, calls, final)
        index = self._buf.find(self.start_tag)
        if index >= 0:
            if self._state == _TEXT:
                content.append(self._buf[:index])
            self._buf = self._buf[index + len(self.start_tag) :]
            self._state = _CALL
            return True
        keep = 0 if final else partial_suffix_len(self._buf, self.start_tag)
        if self._state == _TEXT:
            content.append(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _take_call(self, content: list[str], calls: list[ToolCallDelta], final: bool) -> bool:
        index = self._buf.find(self.end_tag)
        if index < 0 and not final:
            return False
        body = self._buf if index < 0 else self._buf[:index]
        closing = "" if index < 0 else self.end_tag
        self._buf = "" if index < 0 else self._buf[index + len(self.end_tag) :]
        call = parse_call(body.strip())
        if call is not None:
            calls += [self._start_call(call[0]), self._arguments(call[1])]
            self._state = _AFTER
        else:
            content.append(self.start_tag + body + closing)
            self._state = _TEXT if not self.num_calls else _AFTER
        return index >= 0
