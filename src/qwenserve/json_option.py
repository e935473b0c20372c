"""A flag whose value is a JSON object (vLLM's dict-valued options), as text from the command
line or as a dict from ``LLM(...)``: one parser, one wording of its two errors."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def json_object_option(flag: str, value: str | Mapping[str, Any]) -> dict[str, Any]:
    """``value`` as a dict; ``ValueError`` naming ``flag`` (e.g. ``--additional-config``) when
    it is not JSON or not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{flag} is not valid JSON: {value!r} ({e})") from e
    if not isinstance(value, Mapping):
        raise ValueError(f"{flag} must be a JSON object, got {value!r}")
    return dict(value)
