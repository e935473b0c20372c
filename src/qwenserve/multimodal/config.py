"""MultiModalConfig: the resolved image flags (``--limit-mm-per-prompt`` and its neighbours)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MultiModalConfig:
    image_limit: int = 999  # images per prompt (vLLM's default); 0 disables images
    processor_kwargs: dict = field(default_factory=dict)  # --mm-processor-kwargs
    processor_cache_bytes: int = 4 << 30  # --mm-processor-cache-gb (0: no cache)
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    language_model_only: bool = False


def parse_json_option(name: str, value: str | dict | None) -> dict:
    """A flag given as JSON text (command line) or a dict (``LLM(...)``)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"--{name.replace('_', '-')} is not valid JSON: {value!r} "
                             f"({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"--{name.replace('_', '-')} must be a JSON object, got {value!r}")
    return dict(value)


def resolve_multimodal_config(args: Any) -> MultiModalConfig:
    """From ``EngineArgs``; every value checked here so a bad flag fails at start-up."""
    from qwenserve.entrypoints.media_parts import parse_limit_mm_per_prompt
    from qwenserve.multimodal.processor import resolve_processor_kwargs

    kwargs = parse_json_option("mm_processor_kwargs", args.mm_processor_kwargs)
    resolve_processor_kwargs(kwargs)
    cache_gb = float(args.mm_processor_cache_gb)
    if cache_gb < 0:
        raise ValueError(f"--mm-processor-cache-gb must be >= 0, got {cache_gb}")
    domains = args.allowed_media_domains or ()
    if isinstance(domains, str):
        domains = (domains,)
    return MultiModalConfig(
        image_limit=parse_limit_mm_per_prompt(args.limit_mm_per_prompt),
        processor_kwargs=kwargs,
        processor_cache_bytes=int(cache_gb * (1 << 30)),
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(d.lower() for d in domains),
        language_model_only=bool(args.language_model_only),
    )
