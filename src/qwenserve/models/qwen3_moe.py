"""Qwen3-MoE: Qwen3's attention with mixture-of-experts feed-forward blocks (no shared expert).

Layer i is sparse when ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``
(every layer in released models); others use a dense MLP of ``intermediate_size``.
Under tensor parallelism each rank holds a slice of every expert's intermediate dimension (or,
with expert parallelism, whole experts) and the block's partial sums are all-reduced, one
collective per MLP as for dense layers.
"""

from __future__ import annotations

from torch import nn

from qwenserve.layers.moe import MoEBlock, is_moe_layer
from qwenserve.models.base import ModelContext
from qwenserve.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, ctx: ModelContext, layer_id: int) -> nn.Module:
        cfg = ctx.hf_config
        if is_moe_layer(cfg, layer_id):
            return MoEBlock(cfg, ctx.dtype, ctx.tp, expert_parallel=ctx.expert_parallel,
                            dp_ep=ctx.dp_ep, method=ctx.expert_method(
                                f"model.layers.{layer_id}.mlp.experts", cfg.num_experts))
        return super().make_mlp(ctx, layer_id)
