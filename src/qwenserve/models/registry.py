"""Architecture name (``config.json: architectures[0]``) -> model class, imported lazily.

Adding a model adds one line here and one file beside this one; nothing else branches on it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qwenserve.models.base import ModelClass

# architecture -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("qwenserve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwenserve.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen2ForRewardModel": ("qwenserve.models.qwen2_rm", "Qwen2ForRewardModel"),
    "Qwen3ForCausalLM": ("qwenserve.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwenserve.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwenserve.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("qwenserve.models.qwen3_5",
                                        "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForCausalLM": ("qwenserve.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("qwenserve.models.qwen3_5",
                                           "Qwen3_5MoeForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("qwenserve.models.qwen3_vl",
                                        "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("qwenserve.models.qwen3_vl_moe",
                                           "Qwen3VLMoeForConditionalGeneration"),
    "Qwen3NextForCausalLM": ("qwenserve.models.qwen3_5", "Qwen3NextForCausalLM"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def is_supported(architecture: str) -> bool:
    return architecture in _MODELS


def resolve_architecture(architectures: list[str] | None) -> str:
    """Pick the first supported name, or raise an error that lists what is supported."""
    for name in architectures or []:
        if name in _MODELS:
            return name
    raise ValueError(
        f"Model architectures {architectures or '(none given)'} are not supported by qwenserve. "
        f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
    )


def load_model_class(architecture: str) -> ModelClass:
    module_name, class_name = _MODELS[resolve_architecture([architecture])]
    return getattr(importlib.import_module(module_name), class_name)
