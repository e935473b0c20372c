"""Qwen3-MoE: Qwen3's attention with mixture-of-experts feed-forward blocks (no shared expert).

Layer i is sparse when ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``
(every layer in released models); others use a dense MLP of ``intermediate_size``.
Under tensor parallelism each rank holds a slice of every expert's intermediate dimension and the
block's partial sums are all-reduced, one collective per MLP as for dense layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from qwenserve.layers.moe import MoEShard, SparseMoeBlock
from qwenserve.models.base import (
    ModelContext,
    check_all_loaded,
    load_named_weights,
    split_module_weights,
)
from qwenserve.models.dense import MLP, DecoderLayer, DenseSwitches
from qwenserve.models.qwen3 import Qwen3ForCausalLM


def moe_shards(ctx: ModelContext, num_experts: int) -> dict[str, MoEShard]:
    """This rank's share of the routed and the shared experts.

    Tensor parallelism slices every expert's intermediate dimension; expert parallelism
    (``--enable-expert-parallel``) gives each rank whole experts instead, as vLLM does over the
    TP ranks, while the shared expert stays sliced. Either way each rank's output is a partial
    sum of the block's output, so one all-reduce (the one TP already does) completes it: tokens
    are replicated on every rank, so the all-gather/reduce-scatter dispatch of vLLM's
    all-to-all backends reduces to this when there is no data parallelism.
    """
    tp = MoEShard(tp_rank=ctx.tp.rank, tp_size=ctx.tp.world_size)
    if not ctx.expert_parallel:
        return {"shard": tp}
    return {"shard": MoEShard.expert_parallel(num_experts, ctx.tp.rank, ctx.tp.world_size),
            "shared_shard": tp}


class MoEBlock(SparseMoeBlock):
    """A SparseMoeBlock whose tensor-parallel partial sums are all-reduced."""

    def __init__(self, ctx: ModelContext, shared_intermediate_size: int = 0,
                 renormalize: bool | None = None) -> None:
        cfg = ctx.hf_config
        super().__init__(
            num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
            hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size,
            renormalize=bool(getattr(cfg, "norm_topk_prob", True)) if renormalize is None
            else renormalize,
            shared_intermediate_size=shared_intermediate_size, dtype=ctx.dtype,
            **moe_shards(ctx, cfg.num_experts))
        for p in self.parameters():
            p.requires_grad_(False)
        self.tp = ctx.tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


def is_sparse_layer(cfg: Any, layer_id: int) -> bool:
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (layer_id not in (getattr(cfg, "mlp_only_layers", None) or [])
            and cfg.num_experts > 0 and (layer_id + 1) % step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        cfg = ctx.hf_config
        switches = self.switches(cfg)
        for i in range(cfg.num_hidden_layers):
            prefix = f"model.layers.{i}"
            mlp = (MoEBlock(ctx) if is_sparse_layer(cfg, i)
                   else MLP(ctx, cfg.intermediate_size, False, f"{prefix}.mlp"))
            self.model.layers[i] = DecoderLayer(ctx, switches, prefix, mlp=mlp)

    @classmethod
    def switches(cls, hf_config: Any) -> DenseSwitches:
        return super().switches(hf_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        blocks = {f"model.layers.{i}.mlp.": layer.mlp for i, layer in enumerate(self.model.layers)
                  if isinstance(layer.mlp, SparseMoeBlock)}
        loaded: set[str] = set()
        skip = ("rotary_emb.inv_freq", "lm_head.weight") if self.tie else ("rotary_emb.inv_freq",)
        rest = split_module_weights(weights, blocks, loaded)
        loaded |= load_named_weights(self, rest, skip=skip)
        check_all_loaded(self, loaded, source)
