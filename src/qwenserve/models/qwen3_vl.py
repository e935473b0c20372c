"""Qwen3-VL (dense): the Qwen3 decoder with M-RoPE, image rows merged into its input embeddings,
and deep-stack features added to its first layers' outputs (``models/vision_language.py``).

Checkpoint names: ``model.language_model.*`` (the decoder, loaded as Qwen3's ``model.*``),
``model.visual.*`` (the tower), ``lm_head.weight``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from qwenserve.models.qwen3 import Qwen3ForCausalLM
from qwenserve.models.vision_language import VisionLanguageMixin


class Qwen3VLForConditionalGeneration(VisionLanguageMixin, Qwen3ForCausalLM):
    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterable[tuple[str, torch.Tensor]]:
        return ((name.replace("model.language_model.", "model.", 1), tensor)
                for name, tensor in weights)
