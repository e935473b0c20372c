"""Parameter values as text -> the JSON type their tool schema declares.

XML tool formats (Qwen3-Coder, Qwen3.5) write every value as text: ``3``, ``true``, ``["a"]``.
The schema says which JSON type the tool expects; a value that does not parse as that type stays
the string the model wrote (the client sees what the model meant, never an invented value).
"""

from __future__ import annotations

import json
import math
from typing import Any

# When a schema allows several types, the first that parses wins (a string always does).
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_ENUM_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows (``type``, ``anyOf``/``oneOf``, ``enum``); empty = any."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)}
    types: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types |= schema_types(sub)
    if not types and isinstance(schema.get("enum"), list):
        types = {_ENUM_TYPES.get(type(v), "string") for v in schema["enum"]}
    if not types and "properties" in schema:
        types = {"object"}
    if not types and "items" in schema:
        types = {"array"}
    return types


def streams_as_string(types: set[str]) -> bool:
    """A value that can only be a string may be streamed before its end is seen."""
    return not types or types == {"string"}


def convert(text: str, types: set[str]) -> Any:
    """``text`` as the first of ``types`` it parses as (in ``_ORDER``), else ``text`` itself."""
    if streams_as_string(types):
        return text
    stripped = text.strip()
    for kind in _ORDER:
        if kind not in types:
            continue
        if kind == "string":
            return text
        ok, value = _PARSERS[kind](stripped)
        if ok:
            return value
    return text


def _null(text: str) -> tuple[bool, Any]:
    return text in ("null", "None"), None


def _integer(text: str) -> tuple[bool, Any]:
    try:
        return True, int(text)
    except ValueError:
        ok, value = _number(text)
        return (True, int(value)) if ok and float(value).is_integer() else (False, None)


def _number(text: str) -> tuple[bool, Any]:
    try:
        value = float(text)
    except ValueError:
        return False, None
    if not math.isfinite(value):  # not a JSON number
        return False, None
    return True, int(value) if value.is_integer() and "." not in text and "e" not in text else value


def _boolean(text: str) -> tuple[bool, Any]:
    lowered = text.lower()  # Python templates render True / False
    return lowered in ("true", "false"), lowered == "true"


def _json_of(kind: type) -> Any:
    def parse(text: str) -> tuple[bool, Any]:
        try:
            value = json.loads(text)
        except ValueError:
            return False, None
        return isinstance(value, kind), value

    return parse


_PARSERS = {
    "null": _null,
    "integer": _integer,
    "number": _number,
    "boolean": _boolean,
    "object": _json_of(dict),
    "array": _json_of(list),
}
