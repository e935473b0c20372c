"""MultiModalConfig: the resolved image flags (``--limit-mm-per-prompt`` and its neighbours),
and the parsing of the ones given as JSON. Plain data: every floor may read it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qwenserve.json_option import json_object_option

DEFAULT_IMAGE_LIMIT = 999  # vLLM's default per modality


@dataclass(frozen=True)
class MultiModalConfig:
    image_limit: int = DEFAULT_IMAGE_LIMIT  # images per prompt; 0 disables images
    processor_kwargs: dict = field(default_factory=dict)  # --mm-processor-kwargs
    processor_cache_bytes: int = 4 << 30  # --mm-processor-cache-gb (0: no cache)
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    language_model_only: bool = False


def parse_json_option(name: str, value: str | dict | None) -> dict:
    """A flag given as JSON text (command line) or a dict (``LLM(...)``)."""
    return {} if value is None else json_object_option(f"--{name.replace('_', '-')}", value)


def parse_limit_mm_per_prompt(value: str | Mapping[str, Any] | None) -> int:
    """``--limit-mm-per-prompt`` -> images allowed per prompt (vLLM's JSON forms: ``{"image": 4}``
    or ``{"image": {"count": 4, "width": ..., "height": ...}}``)."""
    if value is None:
        return DEFAULT_IMAGE_LIMIT
    value = json_object_option("--limit-mm-per-prompt", value)
    counts = {k: v.get("count") if isinstance(v, Mapping) else v for k, v in value.items()}
    # vLLM's dotted form (--limit-mm-per-prompt.image 0) gives the count as text
    counts = {k: int(v) if isinstance(v, str) and v.isdigit() else v for k, v in counts.items()}
    for modality, count in counts.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt: {modality!r} needs a count >= 0, got "
                             f"{value[modality]!r}")
        if modality != "image" and count > 0:
            raise ValueError(f"--limit-mm-per-prompt: {modality} inputs are not supported; "
                             f"only 'image' may be above 0, got {modality}={count}")
    return counts.get("image", DEFAULT_IMAGE_LIMIT)
