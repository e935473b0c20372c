"""MoE reference layer: routing and grouped experts against a per-token loop and HF's blocks,
both checkpoint layouts, and shards that sum to the full layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from qwenserve.layers.moe import FusedMoE, MoEShard, SparseMoeBlock, route_topk

E, TOP_K, H, INTER, I_SHARED = 8, 2, 32, 24, 16


def random_experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, H, generator=gen) * 0.2  # [E, 2I, H], hub fused layout
    down = torch.randn(E, H, INTER, generator=gen) * 0.2  # [E, H, I]
    router = torch.randn(E, H, generator=gen)  # [E, H]
    return gate_up, down, router


def per_expert_names(gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    names = {}
    for e in range(E):
        names[f"experts.{e}.gate_proj.weight"] = gate_up[e, :INTER]
        names[f"experts.{e}.up_proj.weight"] = gate_up[e, INTER:]
        names[f"experts.{e}.down_proj.weight"] = down[e]
    return names


def naive_moe(x, gate_up, down, router, renormalize: bool) -> torch.Tensor:
    """One token and one chosen expert at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ router.T, dim=-1)  # [E]
        weights, ids = probs.topk(TOP_K)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids.tolist(), strict=True):
            gate, up = gate_up[e, :INTER] @ x[t], gate_up[e, INTER:] @ x[t]
            out[t] += w * (down[e] @ (F.silu(gate) * up))
    return out


def make_block(names: dict[str, torch.Tensor], router: torch.Tensor, **kw) -> SparseMoeBlock:
    block = SparseMoeBlock(E, TOP_K, H, INTER, **kw)
    for name, tensor in {**names, "gate.weight": router}.items():
        block.load_weight(name, tensor)
    return block


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@torch.no_grad()
def test_grouped_experts_equal_naive_loop(renormalize: bool, layout: str) -> None:
    gate_up, down, router = random_experts()
    fused = {"experts.gate_up_proj": gate_up, "experts.down_proj": down}
    names = per_expert_names(gate_up, down) if layout == "per_expert" else fused
    block = make_block(names, router, renormalize=renormalize)
    x = torch.randn(37, H)  # [T, H]
    torch.testing.assert_close(block(x), naive_moe(x, gate_up, down, router, renormalize))
    assert torch.equal(block.experts.w13, gate_up) and torch.equal(block.experts.w2, down)


def test_route_topk_weights_in_activation_dtype() -> None:
    logits = torch.randn(5, E, dtype=torch.bfloat16)
    weights, ids = route_topk(logits, TOP_K, renormalize=True)
    assert weights.dtype == torch.bfloat16 and ids.dtype == torch.int64
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(5), atol=1e-2, rtol=0)


@torch.no_grad()
def test_matches_hf_qwen3_moe_block() -> None:
    config = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=INTER,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=False,
    )
    hf_block = Qwen3MoeSparseMoeBlock(config).eval()
    gate_up, down, router = random_experts(1)
    hf_block.experts.gate_up_proj.copy_(gate_up)
    hf_block.experts.down_proj.copy_(down)
    hf_block.gate.weight.copy_(router)
    ours = make_block(per_expert_names(gate_up, down), router, renormalize=False)
    x = torch.randn(2, 9, H)
    torch.testing.assert_close(ours(x.view(-1, H)), hf_block(x).view(-1, H), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_matches_hf_qwen3_5_moe_block_with_shared_expert(dtype: torch.dtype) -> None:
    config = Qwen3_5MoeTextConfig(
        hidden_size=H,
        moe_intermediate_size=INTER,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        shared_expert_intermediate_size=I_SHARED,
    )
    torch.manual_seed(2)
    hf_block = Qwen3_5MoeSparseMoeBlock(config).eval()
    gate_up, down, router = random_experts(2)
    hf_block.experts.gate_up_proj.copy_(gate_up)
    hf_block.experts.down_proj.copy_(down)
    hf_block.gate.weight.copy_(router)
    names = {"experts.gate_up_proj": gate_up, "experts.down_proj": down}
    for name, tensor in hf_block.named_parameters():
        if name.startswith("shared_expert"):
            names[name] = tensor
    ours = make_block(names, router, shared_intermediate_size=I_SHARED).to(dtype)
    x = torch.randn(1, 13, H, dtype=dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    got, want = ours(x.view(-1, H)), hf_block.to(dtype)(x).view(-1, H)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@torch.no_grad()
def test_shards_sum_to_full_layer() -> None:
    """Expert-range and intermediate-slice shards load their part of either layout; their partial
    sums add up to the unsharded layer (what the later all-reduce will do)."""
    gate_up, down, router = random_experts(3)
    names = per_expert_names(gate_up, down)
    x = torch.randn(20, H)
    full = make_block(names, router)(x)
    shards = [
        MoEShard(expert_start=0, num_local_experts=3),
        MoEShard(expert_start=3),
        MoEShard(tp_rank=0, tp_size=2),
        MoEShard(tp_rank=1, tp_size=2),
    ]
    fused = {"experts.gate_up_proj": gate_up, "experts.down_proj": down}
    partial = []
    for i, shard in enumerate(shards):
        block = make_block(fused if i % 2 else names, router, shard=shard)
        partial.append(block(x))
    torch.testing.assert_close(partial[0] + partial[1], full)
    torch.testing.assert_close(partial[2] + partial[3], full, atol=1e-6, rtol=1e-5)


def test_rejects_wrong_shapes_and_names() -> None:
    moe = FusedMoE(E, TOP_K, H, INTER)
    with pytest.raises(ValueError, match="gate_up_proj"):
        moe.load_weight("gate_up_proj", torch.zeros(E, INTER, H))
    with pytest.raises(KeyError):
        moe.load_weight("experts.0.gate.weight", torch.zeros(INTER, H))


@pytest.mark.parametrize("world_size", [2, 3])
@torch.no_grad()
def test_expert_parallel_shards_with_a_sliced_shared_expert_sum_to_full_block(world_size) -> None:
    """--enable-expert-parallel: whole experts per rank (uneven when E % ranks != 0), the shared
    expert sliced as under TP; the ranks' partial sums add up to the unsharded block."""
    gate_up, down, router = random_experts(4)
    gen = torch.Generator().manual_seed(5)
    names = {"experts.gate_up_proj": gate_up, "experts.down_proj": down,
             "shared_expert.gate_proj.weight": torch.randn(I_SHARED, H, generator=gen) * 0.2,
             "shared_expert.up_proj.weight": torch.randn(I_SHARED, H, generator=gen) * 0.2,
             "shared_expert.down_proj.weight": torch.randn(H, I_SHARED, generator=gen) * 0.2,
             "shared_expert_gate.weight": torch.randn(1, H, generator=gen)}
    x = torch.randn(17, H)
    full = make_block(names, router, shared_intermediate_size=I_SHARED)(x)
    shards = [MoEShard.expert_parallel(E, r, world_size) for r in range(world_size)]
    held = [list(s.expert_range(E)) for s in shards]
    assert sum(held, []) == list(range(E))  # every expert exactly once, in order
    assert max(map(len, held)) - min(map(len, held)) <= 1
    total = torch.zeros_like(full)
    for rank, shard in enumerate(shards):
        shared = MoEShard(tp_rank=rank % 2, tp_size=2) if world_size == 2 else None
        block = make_block(names, router, shared_intermediate_size=I_SHARED, shard=shard,
                           shared_shard=shared)
        out = block(x)
        if shared is None:  # 3 ranks: shared expert whole on rank 0 only, for this check
            out = out if rank == 0 else block.experts(x, block.gate(x))
        total += out
    torch.testing.assert_close(total, full, atol=1e-6, rtol=1e-5)


def test_expert_parallel_needs_an_expert_per_rank() -> None:
    with pytest.raises(ValueError, match="at least one expert per rank"):
        MoEShard.expert_parallel(2, 0, 4)
