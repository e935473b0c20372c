"""Find a model's config for planning: a folder, a config.json, a GGUF file or a cached hub id."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlannedModel:
    hf_config: Any  # the text config, as the engine reads it
    architecture: str
    name: str  # as the user wrote it (goes into the commands)
    ckpt_dtype: str  # the checkpoint's dtype, for --dtype auto
    folder: str | None  # None for a GGUF file


def load_config(model: str, hf_overrides: dict | None = None) -> PlannedModel:
    """Read the config the engine would read (``--hf-overrides`` merged); nothing is
    downloaded."""
    from qwenserve.models.model_config import read_hf_config
    from qwenserve.models.registry import resolve_architecture

    path = os.path.expanduser(model)
    folder: str | None
    if os.path.isfile(path) and path.endswith(".gguf"):
        from qwenserve.models.gguf_loader import read_gguf_config

        (config, _), ckpt_dtype, folder = read_gguf_config(path), "bfloat16", None
    else:
        if os.path.isfile(path) and os.path.basename(path) == "config.json":
            path = os.path.dirname(os.path.abspath(path))
        elif not os.path.isdir(path):
            path = _cached_hub_folder(model)
        config, _, ckpt_dtype = read_hf_config(path, hf_overrides)
        folder = path
    architecture = resolve_architecture(getattr(config, "architectures", None))
    return PlannedModel(config, architecture, model, ckpt_dtype, folder)


def _cached_hub_folder(repo_id: str) -> str:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json")
    if not isinstance(found, str):
        raise ValueError(f"{repo_id} is not a folder and its config.json is not in the local hub "
                         f"cache; run `huggingface-cli download {repo_id} config.json` or pass "
                         "the model folder")
    return os.path.dirname(found)
