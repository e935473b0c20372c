"""What a Qwen vision-language decoder adds to its text model: the vision tower, M-RoPE, and the
merge of image rows into the input embeddings (plus Qwen3-VL's deep-stack features).

    input ids   t t P P P P t        P: the image placeholder token
    embeddings  e e v v v v e        v: rows of the vision tower's output (``batch.mm``)
    positions   [3, T] M-RoPE        (a text-only step keeps [T]: the same rotation)
    layer i < len(deepstack): hidden[image rows] += deepstack[i]   (Qwen3-VL)

``--language-model-only`` (``vision_config`` removed from the config) builds no tower.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from qwenserve.layers.caches import ModelCaches
from qwenserve.layers.forward_batch import ForwardBatch
from qwenserve.layers.moe import SparseMoeBlock
from qwenserve.layers.mrope import MRotaryEmbedding, mrope_layout
from qwenserve.logger import init_logger
from qwenserve.models.base import (
    ModelContext,
    check_all_loaded,
    load_named_weights,
    split_module_weights,
)
from qwenserve.models.vision.tower import VISION_PREFIX, Qwen3VisionTower, VisionOutput

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = init_logger(__name__)

AfterLayer = Callable[[int, torch.Tensor], torch.Tensor]


class VisionLanguageMixin:
    """Mixed in before a ``DenseForCausalLM`` architecture (Qwen3.5, Qwen3): its decoder plus
    the tower, M-RoPE, the image rows and the deep-stack hook; ``model.visual.*`` tensors go to
    the tower."""

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)  # type: ignore[call-arg]
        self.visual = build_vision(self.model, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                caches: ModelCaches) -> torch.Tensor:
        decoder = self.model
        x, positions, after_layer = merge_images(decoder.embed_tokens(input_ids), positions,
                                                 batch)
        if after_layer is None:  # the text model's layers (a text-only step: a replayable one)
            return decoder.run_layers(x, positions, batch, caches)
        residual = None
        for i, layer in enumerate(decoder.layers):
            x, residual = layer(positions, x, residual, batch, caches, decoder.rotary)
            if after_layer is not None:
                x = after_layer(i, x)
        x, _ = decoder.norm(x, residual)
        return x

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> VisionOutput:
        assert self.visual is not None, "text-only model (--language-model-only)"
        return self.visual(pixel_values, grids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        vision: list[tuple[str, torch.Tensor]] = []
        text = self.checkpoint_weights(split_vision_weights(weights, vision, self.visual))
        blocks = {f"model.layers.{i}.mlp.": layer.mlp for i, layer in
                  enumerate(self.model.layers) if isinstance(layer.mlp, SparseMoeBlock)}
        loaded: set[str] = set()
        skip = ("rotary_emb.inv_freq", "lm_head.weight") if self.tie else ("rotary_emb.inv_freq",)
        rest = split_module_weights(text, blocks, loaded)
        loaded |= load_named_weights(self, rest, stacked=self.stacked_params, skip=skip)
        if self.visual is not None:
            loaded |= {"visual." + n for n in self.visual.load_weights(vision)}
        check_all_loaded(self, loaded, source)


def build_vision(model: nn.Module, ctx: ModelContext) -> Qwen3VisionTower | None:
    """Swap the decoder's ``rotary`` for M-RoPE (same tables) and build the tower, if the
    config has one."""
    cfg = ctx.hf_config
    rotary = model.rotary
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if params.get("mrope_section"):
        section, interleaved = mrope_layout(params, default_interleaved=True)
        model.rotary = MRotaryEmbedding(cfg, _head_dim(cfg),
                                        rotary.rotary_dim, ctx.max_model_len, section,
                                        interleaved, rotary.kernels)
    vision_config = getattr(cfg, "vision_config", None)
    if vision_config is None:
        return None
    return Qwen3VisionTower(vision_config, ctx.dtype, ctx.tp,
                            linear=ctx.backends.float_linear)


def _head_dim(cfg: PretrainedConfig) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def merge_images(x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
                 ) -> tuple[torch.Tensor, torch.Tensor, AfterLayer | None]:
    """Image rows into ``x`` [T, hidden], the step's [3, T] positions, and the deep-stack hook."""
    mm = batch.mm
    if mm is None:
        return x, positions, None
    if mm.rows is None or mm.embeds is None:
        return x, mm.mrope_positions, None
    rows = mm.rows
    x = x.index_copy(0, rows, mm.embeds.to(x.dtype))
    if not mm.deepstack:
        return x, mm.mrope_positions, None
    deepstack = [d.to(x.dtype) for d in mm.deepstack]

    def after_layer(i: int, hidden: torch.Tensor) -> torch.Tensor:
        if i >= len(deepstack):
            return hidden
        return hidden.index_add(0, rows, deepstack[i])

    return x, mm.mrope_positions, after_layer


def split_vision_weights(weights: Iterable[tuple[str, torch.Tensor]],
                         vision: list[tuple[str, torch.Tensor]],
                         tower: nn.Module | None) -> Iterable[tuple[str, torch.Tensor]]:
    """Yield the text tensors; the tower's (``model.visual.``) go to ``vision`` by their names
    below the prefix, or are dropped when there is no tower (``--language-model-only``)."""
    dropped = 0
    for name, tensor in weights:
        if name.startswith(VISION_PREFIX):
            if tower is not None:
                vision.append((name[len(VISION_PREFIX):], tensor))
            else:
                dropped += 1
            continue
        yield name, tensor
    if dropped:
        logger.info("Skipped %d vision-tower tensors (--language-model-only)", dropped)
