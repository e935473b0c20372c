"""What a model's files say (config.json or GGUF, generation_config.json), and the dtype and
length resolved from them and the flags; ``engine/arg_utils.py`` builds ``ModelConfig`` from it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qwenserve import envs
from qwenserve.config import ModelSource
from qwenserve.logger import init_logger
from qwenserve.models import registry
from qwenserve.models.source import read_config_json
from qwenserve.options.hf_overrides import (
    apply_to_config,
    check_overrides,
    derived_max_model_len,
    merge_overrides,
)
from qwenserve.pooling import causal_lm_architectures

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from qwenserve.platforms.base import Platform

logger = init_logger(__name__)

_DTYPE_ALIASES = {"float": "float32", "half": "float16"}
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ModelFiles:
    """What a model's files say (``config.ModelConfig`` is built from it with the user's flags)."""

    hf_config: PretrainedConfig = field(repr=False)
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str
    generation_defaults: dict[str, object]


def read_model_files(source: ModelSource, generation_config: str,
                     hf_overrides: dict | None = None) -> ModelFiles:
    """config.json (or the GGUF metadata) and generation_config.json of ``source``;
    ``--hf-overrides`` merged into the config before anything reads it."""
    if source.is_gguf:
        from qwenserve.models.gguf_loader import read_gguf_config

        hf_config, eos_ids = read_gguf_config(source.gguf_file)
        if hf_overrides:
            apply_to_config(hf_config, check_overrides(hf_overrides))
        return ModelFiles(hf_config, eos_ids, "bfloat16", {})
    hf_config, eos_ids, ckpt_dtype = read_hf_config(source.folder, hf_overrides)
    generation = _read_generation_config(source.folder, generation_config)
    eos_ids = _merge_ids(eos_ids, generation.pop("eos_token_id", None))
    return ModelFiles(hf_config, eos_ids, ckpt_dtype, generation)


def read_hf_config(folder: str, hf_overrides: dict | None = None
                   ) -> tuple[PretrainedConfig, tuple[int, ...], str]:
    """(text config, eos ids, checkpoint dtype); ``--hf-overrides`` are merged in before
    anything reads the config (the architecture check included)."""
    overrides = check_overrides(hf_overrides or {})
    raw = merge_overrides(read_config_json(folder), overrides)
    # Check the architecture before transformers parses anything: the error lists what works.
    architectures = causal_lm_architectures(raw)  # a reranker runs its causal LM
    registry.resolve_architecture(architectures)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    apply_to_config(text_config, overrides)
    text_config.architectures = architectures
    if architectures != raw.get("architectures"):  # the name the user gave, for the pooler
        text_config.original_architectures = raw.get("architectures")
    _attach_vision(config, text_config)
    if "quantization_config" in raw and not hasattr(text_config, "quantization_config"):
        text_config.quantization_config = raw["quantization_config"]
    ckpt_dtype = str(raw.get("torch_dtype") or raw.get("dtype")
                     or (raw.get("text_config") or {}).get("dtype") or "float32")
    eos = raw.get("eos_token_id", (raw.get("text_config") or {}).get("eos_token_id"))
    return text_config, _merge_ids((), eos), ckpt_dtype


def _attach_vision(config: PretrainedConfig, text_config: PretrainedConfig) -> None:
    """A vision-language checkpoint's tower config and image token ids ride on the text config
    (the one config the model classes receive). Whether the LM head is tied is the outer
    config's word, as in transformers (Qwen3-VL-MoE's text config says True, its outer config
    False, and HF unties)."""
    vision = getattr(config, "vision_config", None)
    if vision is None or text_config is config:
        return
    text_config.vision_config = vision
    tie = getattr(config, "tie_word_embeddings", None)
    if tie is not None:
        text_config.tie_word_embeddings = tie
    for name in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        setattr(text_config, name, getattr(config, name))


def _read_generation_config(folder: str, mode: str) -> dict:
    """Default sampling parameters (``--generation-config auto|vllm|FOLDER``), as vLLM does."""
    if mode == "vllm":
        return {}
    path = os.path.join(folder if mode == "auto" else mode, "generation_config.json")
    if not os.path.isfile(path):
        if mode != "auto":
            raise ValueError(f"--generation-config {mode}: {path} does not exist")
        return {}
    with open(path) as f:
        raw = json.load(f)
    defaults = {k: raw[k] for k in _SAMPLING_DEFAULT_KEYS if raw.get(k) is not None}
    if raw.get("max_new_tokens") is not None:
        defaults["max_tokens"] = raw["max_new_tokens"]
    if raw.get("eos_token_id") is not None:
        defaults["eos_token_id"] = raw["eos_token_id"]
    # do_sample is not read: vLLM ignores it too, so the same request samples the same way.
    return defaults


def _merge_ids(ids: tuple[int, ...], extra: Any) -> tuple[int, ...]:
    if extra is None:
        return ids
    extra_list = extra if isinstance(extra, list) else [extra]
    return tuple(dict.fromkeys([*ids, *(int(i) for i in extra_list)]))


def resolve_dtype(requested: str, ckpt_dtype: str, platform: Platform) -> str:
    requested = _DTYPE_ALIASES.get(requested, requested)
    if requested != "auto":
        if requested == "float16" and not platform.is_accelerator:
            logger.warning("float16 on CPU is slow and numerically fragile; prefer bfloat16 or "
                           "float32")
        return requested
    if not platform.supports_native_bf16():
        return "float32"
    if platform.is_accelerator:
        return "float16" if ckpt_dtype == "float16" else "bfloat16"
    return "float32" if ckpt_dtype == "float32" else "bfloat16"


def resolve_max_model_len(requested: int | None, hf_config: PretrainedConfig) -> int:
    derived = derived_max_model_len(hf_config)  # max_position_embeddings, x factor with YaRN
    if requested is None:
        return int(derived)
    if requested < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {requested}")
    if requested > derived and not envs.allow_long_max_model_len():
        raise ValueError(
            f"--max-model-len {requested} is larger than the model's maximum of {derived} "
            "tokens (max_position_embeddings, times the YaRN factor if any). Lower it, add "
            "YaRN through --hf-overrides (rope_parameters), or set "
            "QWENSERVE_ALLOW_LONG_MAX_MODEL_LEN=1 if you know the model handles longer inputs."
        )
    return int(requested)
