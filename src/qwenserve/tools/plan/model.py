"""Find a model's config for planning: a folder, a config.json, a GGUF file or a cached hub id."""

from __future__ import annotations

import os
from typing import Any


def load_config(model: str) -> tuple[Any, str, str]:
    """Return (text config, architecture, display name); nothing is downloaded."""
    from qwenserve.models.model_config import read_hf_config
    from qwenserve.models.registry import resolve_architecture

    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from qwenserve.models.gguf_loader import read_gguf_config

        config, _ = read_gguf_config(path)
    else:
        if os.path.isfile(path) and os.path.basename(path) == "config.json":
            path = os.path.dirname(os.path.abspath(path))
        elif not os.path.isdir(path):
            path = _cached_hub_folder(model)
        config, _, _ = read_hf_config(path)
    return config, resolve_architecture(getattr(config, "architectures", None)), model


def _cached_hub_folder(repo_id: str) -> str:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json")
    if not isinstance(found, str):
        raise ValueError(f"{repo_id} is not a folder and its config.json is not in the local hub "
                         f"cache; run `huggingface-cli download {repo_id} config.json` or pass "
                         "the model folder")
    return os.path.dirname(found)
