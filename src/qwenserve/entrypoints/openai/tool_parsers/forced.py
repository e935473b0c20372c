"""Tool calls whose shape a structured-output constraint forced (``tool_choice`` named or
``"required"``). These are not ``--tool-call-parser`` formats: the grammar made the model write

- named function: the arguments JSON object itself; every text delta is an arguments delta;
- ``"required"``: a JSON array ``[{"name": ..., "parameters": {...}}, ...]``; each call goes out
  once its array element is complete (the stdlib decoder finds where an element ends).
"""

from __future__ import annotations

import json

from qwenserve.entrypoints.openai.tool_parsers.base import ToolCallDelta, ToolParser


class NamedToolParser(ToolParser):
    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        deltas = [] if self.num_calls else [self._start_call(self._name)]
        if delta:
            deltas.append(self._arguments(delta))
        return "", deltas


class RequiredToolsParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._pos = 0  # where the next array element (or its separator) starts
        self._decoder = json.JSONDecoder()

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self._buf += delta
        deltas: list[ToolCallDelta] = []
        while (item := self._next_item()) is not None:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                args = item.get("parameters", item.get("arguments", {}))
                deltas += [self._start_call(item["name"]),
                           self._arguments(json.dumps(args, ensure_ascii=False))]
        return "", deltas

    def _next_item(self) -> object | None:
        """The next complete element of the array, or None while it is still arriving."""
        text = self._buf
        pos = self._pos
        while pos < len(text) and text[pos] in " \t\r\n[,":
            pos += 1
        try:
            item, end = self._decoder.raw_decode(text, pos)
        except ValueError:
            return None
        self._pos = end
        return item
