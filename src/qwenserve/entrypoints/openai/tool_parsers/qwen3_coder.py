"""Qwen3-Coder and Qwen3.5/3.6 XML tool calls (``--tool-call-parser qwen3_coder``, or
``qwen3_xml``), as their chat templates write them::

    Let me check.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

gives content ``"Let me check."`` and a call ``get_weather`` with arguments
``{"city": "Paris", "days": 3}``: the template's newline after ``<parameter=K>`` and before
``</parameter>`` are markup, and each value takes the JSON type its tool schema declares
(``schema_types.convert``). One incremental state machine serves streams and whole answers:

    TEXT --<tool_call>--> HEADER --<function=NAME>--> ARGS --<parameter=K>--> VALUE
      ^                                                |  ^-------</parameter>-----'
      '------- AFTER <--</tool_call>-- CLOSING <--</function>--'

A call's name goes out as soon as ``<function=NAME>`` is complete; its arguments then stream as
JSON fragments: string values character by character, other values when their tag closes.
Whitespace around calls is markup and dropped; other text before, between or after calls is
content. A ``<tool_call>`` not followed by a well-formed ``<function=NAME>`` stays content; a call
cut off after its header (``max_tokens``) is closed with the arguments it has.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from qwenserve.entrypoints.openai.reasoning.qwen3 import partial_suffix_len
from qwenserve.entrypoints.openai.tool_parsers.base import (
    JSONSchema,
    ToolCallDelta,
    ToolParser,
    tool_parameters,
)
from qwenserve.entrypoints.openai.tool_parsers.schema_types import (
    convert,
    schema_types,
    streams_as_string,
)

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
FUNC_START, FUNC_END = "<function=", "</function>"
PARAM_START, PARAM_END = "<parameter=", "</parameter>"
_MAX_NAME_CHARS = 256  # a longer "name" is not a header: the text goes back to content

_TEXT, _HEADER, _ARGS, _VALUE, _CLOSING, _AFTER = (
    "text", "header", "args", "value", "closing", "after"
)


def _json_chars(text: str) -> str:
    """``text`` escaped as inside a JSON string (escaping is per character, so pieces concat)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


@dataclass
class _Param:
    types: set[str]
    streams: bool  # a string: sent as it arrives
    started: bool = False  # the leading newline (markup) has been dealt with
    pending: str = ""  # received, not yet sent (a possible trailing newline)
    text: str = ""  # sent so far (non-string values: kept for the conversion at the end)


class Qwen3CoderToolParser(ToolParser):
    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._state = _TEXT
        self._buf = ""
        self._ws = ""  # whitespace held back: dropped if a call follows
        self._after_started = False  # content after a call has begun (its leading ws dropped)
        self._props: JSONSchema = {}
        self._num_params = 0
        self._param: _Param | None = None
        self._handlers = {
            _TEXT: self._in_text,
            _AFTER: self._in_text,
            _HEADER: self._in_header,
            _ARGS: self._in_args,
            _VALUE: self._in_value,
            _CLOSING: self._in_closing,
        }

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self._buf += delta
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._handlers[self._state](content, deltas, final):
            pass
        if final:
            if self._state in (_ARGS, _VALUE):  # cut off inside a call: close what is open
                self._close_call(deltas)
            if not self.num_calls:
                content.append(self._ws)
            self._ws = ""
        return "".join(content), deltas

    # ---- text outside calls ---------------------------------------------------------------------
    def _in_text(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        index = self._buf.find(TOOL_START)
        if index >= 0:
            self._emit_text(content, self._buf[:index])
            self._buf = self._buf[index + len(TOOL_START) :]
            self._state = _HEADER
            return True
        keep = 0 if final else partial_suffix_len(self._buf, TOOL_START)
        self._emit_text(content, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _emit_text(self, content: list[str], text: str) -> None:
        """Content, with whitespace runs held until non-whitespace text follows them."""
        pending = self._ws + text
        body = pending.rstrip()
        self._ws = pending[len(body) :]
        if not body:
            return
        if self.num_calls and not self._after_started:
            body, self._after_started = body.lstrip(), True
        content.append(body)

    # ---- a call ---------------------------------------------------------------------------------
    def _in_header(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        s = self._buf.lstrip()
        if s.startswith(FUNC_START):
            end = s.find(">")
            name = s[len(FUNC_START) : end if end >= 0 else len(s)]
            plausible = len(name) <= _MAX_NAME_CHARS and not any(c in name for c in "<\n")
            if end >= 0 and plausible and name.strip():
                self._buf = s[end + 1 :]
                self._begin_call(name.strip(), deltas)
                return True
            if end < 0 and plausible and not final:
                return False  # the name is still arriving
        elif not final and FUNC_START.startswith(s):
            return False
        # Not a call after all: the tag is content, and the rest is scanned again as text.
        self._state = _AFTER if self.num_calls else _TEXT
        self._emit_text(content, TOOL_START)
        return True

    def _begin_call(self, name: str, deltas: list[ToolCallDelta]) -> None:
        self._ws, self._after_started = "", False
        deltas.append(self._start_call(name))
        self._props = tool_parameters(self.tools, name)
        self._num_params = 0
        self._state = _ARGS

    def _in_args(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        s = self._buf.lstrip()
        if s.startswith(PARAM_START):
            end = s.find(">")
            if end < 0:
                self._buf = s
                return False  # the parameter name is still arriving (or was cut off)
            self._buf = s[end + 1 :]
            self._open_param(s[len(PARAM_START) : end].strip(), deltas)
            return True
        for tag, state in ((FUNC_END, _CLOSING), (TOOL_END, _AFTER)):  # </tool_call>: lenient
            if s.startswith(tag):
                self._buf = s[len(tag) :]
                self._close_call(deltas)
                self._state = state
                return True
        if not final and any(t.startswith(s) for t in (PARAM_START, FUNC_END, TOOL_END)):
            self._buf = s
            return False
        if not s:
            self._buf = ""
            return False
        # Stray text between parameters is not part of the call: skip to the next tag.
        next_tag = s.find("<", 1)
        self._buf = s[next_tag:] if next_tag > 0 else ""
        return next_tag > 0

    def _open_param(self, name: str, deltas: list[ToolCallDelta]) -> None:
        types = schema_types(self._props.get(name))
        self._param = _Param(types, streams_as_string(types))
        opening = ("{" if self._num_params == 0 else ", ") + json.dumps(name, ensure_ascii=False)
        deltas.append(self._arguments(opening + (': "' if self._param.streams else ": ")))
        self._num_params += 1
        self._state = _VALUE

    def _in_value(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        index = self._buf.find(PARAM_END)
        if index >= 0:
            self._value_text(self._buf[:index], deltas, closing=True)
            self._buf = self._buf[index + len(PARAM_END) :]
            self._state = _ARGS
            return True
        keep = 0 if final else partial_suffix_len(self._buf, PARAM_END)
        self._value_text(self._buf[: len(self._buf) - keep], deltas, closing=final)
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _value_text(self, piece: str, deltas: list[ToolCallDelta], closing: bool) -> None:
        """Send what is certain of a value; the template's newlines around it are dropped."""
        param = self._param
        assert param is not None
        param.pending += piece
        if not param.started:
            if not param.pending and not closing:
                return
            if param.pending.startswith("\n"):
                param.pending = param.pending[1:]
            param.started = True
        if closing:
            last = param.pending[:-1] if param.pending.endswith("\n") else param.pending
            if param.streams:
                fragment = _json_chars(last) + '"'
            else:
                value = convert(param.text + last, param.types)
                fragment = json.dumps(value, ensure_ascii=False)
            deltas.append(self._arguments(fragment))
            self._param = None
            return
        sendable = param.pending[:-1] if param.pending.endswith("\n") else param.pending
        param.pending = param.pending[len(sendable) :]
        if param.streams and sendable:
            deltas.append(self._arguments(_json_chars(sendable)))
        elif not param.streams:
            param.text += sendable

    def _close_call(self, deltas: list[ToolCallDelta]) -> None:
        if self._param is not None:
            self._value_text("", deltas, closing=True)
        deltas.append(self._arguments("}" if self._num_params else "{}"))
        self._state = _AFTER

    def _in_closing(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        s = self._buf.lstrip()
        if s.startswith(TOOL_END):
            self._buf = s[len(TOOL_END) :]
        elif not final and TOOL_END.startswith(s):
            return False
        self._state = _AFTER
        return True
