"""Tensor-parallel pieces of the Gated DeltaNet layer.

The DeltaNet projections are four checkpoint matrices (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``) computed here as one GEMM. Every output part is split by heads over
ranks; ``in_proj_qkv`` itself stacks three parts (q and k: key heads, v: value heads), so it and
the depthwise conv weight are split part by part:

    rows of in_proj_qkv / conv1d:  [ q: Hk*Dk | k: Hk*Dk | v: Hv*Dv ]
    rank r keeps                   [ q_r      | k_r      | v_r      ]   (each part's r-th slice)
"""

from __future__ import annotations

import torch
from torch import nn

from qwenserve.distributed.parallel_group import ParallelGroup
from qwenserve.layers.linear import MergedColumnParallelLinear, copy_checked, set_dims
from qwenserve.models.base import ModelContext

_PARTS = {"z": 3, "b": 4, "a": 5}


def shard_rows(tensor: torch.Tensor, sizes: list[int], tp: ParallelGroup) -> torch.Tensor:
    """Concatenate this rank's slice of each consecutive row block of ``sizes`` (full sizes)."""
    pieces, start = [], 0
    for size in sizes:
        local = size // tp.world_size
        pieces.append(tensor.narrow(0, start + tp.rank * local, local))
        start += size
    return torch.cat(pieces, dim=0)


def sharded_parameter(size: int, tp: ParallelGroup, dtype: torch.dtype) -> nn.Parameter:
    """A per-head vector (``dt_bias``, ``A_log``) holding this rank's heads."""
    local = tp.shard(size, "linear_num_value_heads")
    param = nn.Parameter(torch.empty(local, dtype=dtype), requires_grad=False)

    def load(p: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(p.data, loaded.narrow(0, tp.rank * local, local))

    param.weight_loader = load
    return param


class GDNInProj(MergedColumnParallelLinear):
    """[q | k | v | z | b | a] in one GEMM; ``forward`` returns (qkv, z, b, a)."""

    def __init__(self, ctx: ModelContext, prefix: str) -> None:
        cfg = ctx.hf_config
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        heads = cfg.linear_num_value_heads
        self.full_qkv_sizes = [key_dim, key_dim, value_dim]
        quant = ctx.linear_method(prefix)
        super().__init__(cfg.hidden_size, [key_dim, key_dim, value_dim, value_dim, heads, heads],
                         bias=False, dtype=ctx.dtype, tp=ctx.tp, quant_method=quant)
        self.conv_dim = sum(self.output_sizes[:3])  # per rank

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = super().forward(x)
        qkv = self.conv_dim
        v_local, heads = self.output_sizes[3], self.output_sizes[4]
        return tuple(out.split([qkv, v_local, heads, heads], dim=-1))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id != "qkv":
            super().weight_loader(param, loaded, _PARTS[shard_id])
            return
        start = 0
        for i, size in enumerate(self.full_qkv_sizes):
            super().weight_loader(param, loaded.narrow(0, start, size), i)
            start += size

    def make_conv_weight(self, kernel_size: int) -> nn.Module:
        """The depthwise conv's weight [conv_dim, K], split over ranks like q/k/v."""
        conv = nn.Module()
        conv.weight = nn.Parameter(torch.empty(self.conv_dim, kernel_size,
                                               dtype=self.weight.dtype if self.weight.is_floating_point()
                                               else torch.float32), requires_grad=False)
        set_dims(conv.weight, output_dim=0, input_dim=None)
        sizes, tp = self.full_qkv_sizes, self.tp

        def load(p: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            copy_checked(p.data, shard_rows(loaded.reshape(loaded.shape[0], -1), sizes, tp))

        conv.weight.weight_loader = load
        return conv
