"""``--hf-overrides``: a JSON object merged into the model's Hugging Face config before anything
reads it (architecture, rope, sizes), as vLLM does; and vLLM's context length under YaRN.

Nested objects merge key by key (``{"rope_parameters": {"rope_type": "yarn", ...}}`` keeps the
checkpoint's ``rope_theta`` when the override leaves it out); other values replace.
"""

from __future__ import annotations

from typing import Any

# rope types that stretch the context by ``factor`` (vLLM's _get_and_verify_max_len)
_SCALED_ROPE_TYPES = ("yarn", "linear", "dynamic")


def merge_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied; nested dicts merged recursively (inputs untouched)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_overrides(out[key], value)
        else:
            out[key] = value
    return out


def check_overrides(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"--hf-overrides must be a JSON object of config keys, got {value!r}")
    return value


def apply_to_config(config: Any, overrides: dict[str, Any]) -> None:
    """Set each override on a transformers config object (dict-valued ones merged)."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, dict):
            value = merge_overrides(current, value)
        setattr(config, key, value)


def rope_scaling_dict(config: Any) -> dict[str, Any]:
    """The rope parameters of a config: v5 ``rope_parameters`` or v4 ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    return {**scaling, **params}


def derived_max_model_len(config: Any) -> int:
    """vLLM's default context length: ``max_position_embeddings``; with YaRN
    ``original_max_position_embeddings * factor``; with linear/dynamic scaling ``* factor``."""
    derived = int(getattr(config, "max_position_embeddings", None) or 4096)
    rope = rope_scaling_dict(config)
    rope_type = rope.get("rope_type") or rope.get("type")
    factor = rope.get("factor")
    if rope_type not in _SCALED_ROPE_TYPES or not factor:
        return derived
    if rope_type == "yarn":
        derived = int(rope.get("original_max_position_embeddings") or derived)
    return int(derived * float(factor))
