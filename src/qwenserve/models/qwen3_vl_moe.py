"""Qwen3-VL-MoE: Qwen3-VL's tower, M-RoPE and deep-stack features over the Qwen3-MoE decoder
(``layers/moe.py``'s shared MoE block; softmax routing, top-k renormalized).

Checkpoint names are Qwen3-VL's (``model.language_model.*``, ``model.visual.*``). The experts
come fused: ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``. Published checkpoints
store them input-major, ``[E, H, 2I]`` and ``[E, I, H]``; transformers keeps (and saves)
``[E, 2I, H]`` and ``[E, H, I]``. As transformers does, a tensor whose shape is not the
block's layout is transposed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from qwenserve.models.base import ModelContext
from qwenserve.models.qwen3_moe import Qwen3MoeForCausalLM
from qwenserve.models.qwen3_vl import Qwen3VLForConditionalGeneration
from qwenserve.models.vision_language import VisionLanguageMixin


class Qwen3VLMoeForConditionalGeneration(VisionLanguageMixin, Qwen3MoeForCausalLM):
    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        hidden, inter = ctx.hf_config.hidden_size, ctx.hf_config.moe_intermediate_size
        # one expert's fused tensors as the MoE block loads them
        self.expert_layout = {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterable[tuple[str, torch.Tensor]]:
        renamed = Qwen3VLForConditionalGeneration.checkpoint_weights(self, weights)
        for name, tensor in renamed:
            kind = name.rsplit(".", 1)[-1]
            layout = self.expert_layout.get(kind)
            if (layout is not None and ".mlp.experts." in name and tensor.dim() == 3
                    and tuple(tensor.shape[1:]) != layout):
                tensor = tensor.transpose(1, 2)  # the published input-major layout
            yield name, tensor
