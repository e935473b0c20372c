"""StructuredOutputsParams (vLLM's fields) and the GrammarSpec the engine compiles (no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: a kind and its source text. Hashable: the compile cache's key."""

    kind: str  # json | json_object | regex | grammar | structural_tag
    source: str
    any_whitespace: bool = True  # json kinds: allow whitespace between tokens

    def describe(self) -> str:
        shown = self.source if len(self.source) <= 80 else self.source[:77] + "..."
        return f"{self.kind} {shown!r}" if self.source else self.kind


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output, with vLLM's names (``SamplingParams.
    structured_outputs``): exactly one of ``json`` (a JSON schema, dict or string), ``regex``,
    ``choice`` (a list of strings), ``grammar`` (EBNF), ``json_object`` or ``structural_tag``."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            what = "none" if not given else " and ".join(given)
            raise ValueError(
                "structured_outputs needs exactly one constraint (json, regex, choice, grammar, "
                f"json_object or structural_tag); got {what}"
            )
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported by the xgrammar backend; "
                "remove it (disable_any_whitespace gives compact JSON)"
            )
        if self.disable_additional_properties:
            raise ValueError(
                "structured_outputs.disable_additional_properties is only for vLLM's guidance "
                "backend; xgrammar already refuses properties the schema does not list"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    def to_spec(self) -> GrammarSpec:
        """The compile request. ``choice`` becomes an EBNF alternation of literals."""
        whitespace = not self.disable_any_whitespace
        if self.json is not None:
            source = self.json if isinstance(self.json, str) else _dumps(self.json)
            return GrammarSpec("json", source, whitespace)
        if self.json_object is not None:
            return GrammarSpec("json_object", "", whitespace)
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return GrammarSpec("grammar", "root ::= " + " | ".join(_dumps(c) for c in self.choice))
        if self.grammar is not None:
            return GrammarSpec("grammar", self.grammar)
        return GrammarSpec("structural_tag", str(self.structural_tag))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
