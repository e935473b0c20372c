"""A small random MoE block (routed + shared experts) and its DP x EP shards, for the tests of
the MoE exchange over data-parallel replicas on gloo processes."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from qwenserve.distributed.parallel_group import SINGLE, ParallelGroup
from qwenserve.layers.moe import MoEBlock

CFG = SimpleNamespace(num_experts=5, num_experts_per_tok=2, hidden_size=16,
                      moe_intermediate_size=8, norm_topk_prob=True)


def whole_block(seed: int = 0) -> MoEBlock:
    """The whole layer on one device (the same weights in every process for one seed)."""
    torch.manual_seed(seed)
    block = MoEBlock(CFG, torch.float32, SINGLE, shared_intermediate_size=8)
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    return block


def sharded_like(full: MoEBlock, tp: ParallelGroup, dp_ep: ParallelGroup) -> MoEBlock:
    """This rank's share of ``full``: its whole experts, its slice of the shared expert."""
    block = MoEBlock(CFG, torch.float32, tp, shared_intermediate_size=8, dp_ep=dp_ep)
    for mine, whole in ((block.experts, full.experts), (block.shared_expert, full.shared_expert)):
        inter = whole.intermediate_size
        for e in range(whole.num_experts):
            mine.load_expert(e, "gate", whole.w13[e, :inter])
            mine.load_expert(e, "up", whole.w13[e, inter:])
            mine.load_expert(e, "down", whole.w2[e])
    block.shared_expert_gate.load_state_dict(full.shared_expert_gate.state_dict())
    block.gate.load_state_dict(full.gate.state_dict())
    return block
