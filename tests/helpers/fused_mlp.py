"""A small bf16 MLP on a platform's backends, and the check that its fused gate_up + SiLU seam
gives the unfused path's output: shared by the AMX and packed-GEMM fusion tests."""

from __future__ import annotations

import torch
from transformers import Qwen2Config

from qwenserve.layers.backends import Backends
from qwenserve.models.base import ModelContext
from qwenserve.models.dense import MLP


def small_mlp(backends: Backends, bias: bool, inter: int) -> MLP:
    """hidden 64, intermediate ``inter``, seeded weights (and biases: EAGLE-3's midlayer MLP
    has them)."""
    cfg = Qwen2Config(hidden_size=64, intermediate_size=inter, num_attention_heads=4)
    mlp = MLP(ModelContext(cfg, torch.bfloat16, 64, backends=backends), inter, bias, "mlp")
    gen = torch.Generator().manual_seed(0)
    mlp.gate_up_proj.weight.data.copy_(torch.randn(2 * inter, 64, generator=gen) / 8)
    mlp.down_proj.weight.data.copy_(torch.randn(64, inter, generator=gen) / inter ** 0.5)
    if bias:
        mlp.gate_up_proj.bias.data.copy_(torch.randn(2 * inter, generator=gen))
    return mlp


def fused_calls_match_unfused(mlp: MLP, rows: tuple[int, ...]) -> list[bool]:
    """Runs the MLP on x of each row count with its seam and without it (asserting equal
    outputs) and returns, per call the seam got, whether the fused kernel took it."""
    seam, taken = mlp.gate_up_silu, []
    assert seam is not None
    mlp.gate_up_silu = lambda *a: taken.append(seam(*a)) or taken[-1]
    for n in rows:
        x = torch.randn(n, 64).bfloat16()
        with torch.no_grad():
            got = mlp(x)
            tracked, mlp.gate_up_silu = mlp.gate_up_silu, None
            want = mlp(x)
            mlp.gate_up_silu = tracked
        assert torch.equal(got, want), n
    mlp.gate_up_silu = seam
    return [t is not None for t in taken]
