"""Qwen3-VL (dense): the Qwen3 decoder with M-RoPE, image rows merged into its input embeddings,
and deep-stack features added to its first layers' outputs (``models/vision_language.py``).

Checkpoint names: ``model.language_model.*`` (the decoder, loaded as Qwen3's ``model.*``),
``model.visual.*`` (the tower), ``lm_head.weight``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from qwenserve.models.base import ModelContext, check_all_loaded, load_named_weights
from qwenserve.models.qwen3 import Qwen3ForCausalLM
from qwenserve.models.vision.tower import VisionOutput
from qwenserve.models.vision_language import build_vision, merge_images, split_vision_weights
from qwenserve.layers.caches import ModelCaches
from qwenserve.layers.forward_batch import ForwardBatch


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        self.rotary = self.model.rotary
        self.visual = build_vision(self, ctx)  # swaps self.rotary for M-RoPE
        self.model.rotary = self.rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                caches: ModelCaches) -> torch.Tensor:
        x, positions, after_layer = merge_images(self.model.embed_tokens(input_ids), positions,
                                                 batch)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(positions, x, residual, batch, caches.kv[i], self.model.rotary)
            if after_layer is not None:
                x = after_layer(i, x)
        x, _ = self.model.norm(x, residual)
        return x

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> VisionOutput:
        assert self.visual is not None, "text-only model (--language-model-only)"
        return self.visual(pixel_values, grids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        vision: list[tuple[str, torch.Tensor]] = []
        text = ((name.replace("model.language_model.", "model.", 1), tensor)
                for name, tensor in split_vision_weights(weights, vision, self.visual))
        skip = ("rotary_emb.inv_freq", "lm_head.weight") if self.tie else ("rotary_emb.inv_freq",)
        loaded = load_named_weights(self, text, skip=skip)
        if self.visual is not None:
            loaded |= {"visual." + n for n in self.visual.load_weights(vision)}
        check_all_loaded(self, loaded, source)
