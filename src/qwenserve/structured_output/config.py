"""``--structured-outputs-config``: vLLM's StructuredOutputsConfig, as JSON or dotted flags
(``--structured-outputs-config.backend xgrammar``). No torch, no xgrammar."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from qwenserve.json_option import json_object_option

SUPPORTED_BACKENDS = ("auto", "xgrammar")
VLLM_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"  # auto = xgrammar, the one backend qwenserve runs
    disable_any_whitespace: bool = False  # compact JSON: no whitespace between tokens
    disable_additional_properties: bool = False  # vLLM's guidance backend only
    enable_in_reasoning: bool = False  # constrain the reasoning block too
    reasoning_parser: str = ""  # vLLM also takes --reasoning-parser here
    reasoning_parser_plugin: str = ""


def parse_structured_outputs_config(value: str | dict[str, Any] | None
                                    ) -> StructuredOutputsConfig:
    """The flag's value -> config; ``ValueError`` names the key or value to fix."""
    if value is None:
        return StructuredOutputsConfig()
    value = json_object_option("--structured-outputs-config", value)
    names = {f.name: f for f in fields(StructuredOutputsConfig)}
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"--structured-outputs-config: unknown key(s) {unknown}; known: "
                         f"{', '.join(names)}")
    values = {k: _coerce(k, v, names[k].default) for k, v in value.items()}
    config = StructuredOutputsConfig(**values)
    if config.backend not in SUPPORTED_BACKENDS:
        what = "is not implemented in qwenserve" if config.backend in VLLM_BACKENDS \
            else "is unknown"
        raise ValueError(f"--structured-outputs-config backend {config.backend!r} {what}; use "
                         "xgrammar (or auto)")
    if config.disable_additional_properties:
        raise ValueError("--structured-outputs-config disable_additional_properties is only "
                         "for vLLM's guidance backend; remove it")
    if config.reasoning_parser_plugin:
        raise ValueError("--structured-outputs-config reasoning_parser_plugin is not "
                         "implemented in qwenserve; remove it")
    return config


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Dotted flags arrive as strings: ``true``/``false`` for the boolean keys."""
    if isinstance(default, bool) and isinstance(value, str):
        if value.lower() not in ("true", "false"):
            raise ValueError(f"--structured-outputs-config {key} must be true or false, "
                             f"got {value!r}")
        return value.lower() == "true"
    if type(value) is not type(default):
        raise ValueError(f"--structured-outputs-config {key} must be a "
                         f"{type(default).__name__}, got {value!r}")
    return value


def fold_dotted_flags(argv: list[str], flag: str) -> list[str]:
    """vLLM's dotted form ``FLAG.key value`` / ``FLAG.key=value`` -> one ``FLAG {json}``, merged
    over a JSON ``FLAG`` value given before it."""
    if not any(arg.startswith(flag + ".") for arg in argv):
        return argv
    merged: dict[str, Any] = {}
    out: list[str] = []
    dotted = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(flag + "."):
            key, _, value = arg[len(flag) + 1 :].partition("=")
            if not _:
                value = argv[i + 1] if i + 1 < len(argv) else ""
                i += 1
            merged[key.replace("-", "_")] = value
            dotted = True
        elif arg == flag and i + 1 < len(argv) and not dotted:
            try:
                base = json.loads(argv[i + 1])
            except ValueError:
                base = None
            if isinstance(base, dict):
                merged = {**base, **merged}
                i += 2
                continue
            out.append(arg)
        else:
            out.append(arg)
        i += 1
    return [*out, flag, json.dumps(merged)]
