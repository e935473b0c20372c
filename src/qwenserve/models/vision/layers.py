"""The blocks of the Qwen3-VL / Qwen3.5 vision transformer, tensor-parallel by heads. Their
GEMMs run through ``linear`` (the platform's float GEMM, ``Backends.float_linear``; the tower
is never quantized).

    block:  x + attn(LN(x)) -> x + MLP(LN(x))
            attn: fused qkv (column-parallel: this rank's heads) -> 2-D rotary on q, k ->
                  block-diagonal attention per frame -> proj (row-parallel, all-reduced)
            MLP:  fc1 (column-parallel) -> GELU(tanh) -> fc2 (row-parallel)
    merger: LN -> merge x merge neighbours concatenated -> fc1 -> GELU -> fc2 (LLM width);
            deep-stack mergers (Qwen3-VL) normalize after concatenating instead
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.distributed.parallel_group import ParallelGroup
from qwenserve.layers.linear import (
    ColumnParallelLinear,
    LinearMethod,
    QKVParallelLinear,
    RowParallelLinear,
)
from qwenserve.layers.varlen_attention import VarlenAttention

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Activation = Callable[[torch.Tensor], torch.Tensor]
_ACTIVATIONS: dict[str, Activation] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}
LAYER_NORM_EPS = 1e-6  # HF's Qwen3-VL / Qwen3.5 vision LayerNorms


def activation(name: str) -> Activation:
    if name not in _ACTIVATIONS:
        raise ValueError(f"vision_config.hidden_act {name!r} is not supported; supported: "
                         f"{', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def rotate_vision(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over the whole head (``rotate_half`` form) in fp32, as HF does; x [N, H, D]."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, cfg: PretrainedConfig, dtype: torch.dtype, tp: ParallelGroup,
                 attention: VarlenAttention, linear: LinearMethod) -> None:
        super().__init__()
        dim, heads = cfg.hidden_size, cfg.num_heads
        self.head_dim = dim // heads
        self.qkv = QKVParallelLinear(dim, self.head_dim, heads, heads, bias=True, dtype=dtype,
                                     tp=tp, quant_method=linear)
        self.num_heads = self.qkv.num_heads  # this rank's
        self.proj = RowParallelLinear(dim, dim, bias=True, dtype=dtype, tp=tp,
                                      quant_method=linear)
        self.attention = attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: Sequence[int]) -> torch.Tensor:
        n, shape = x.shape[0], (x.shape[0], self.num_heads, self.head_dim)
        q, k, v = self.qkv(x).split([self.qkv.q_size, self.qkv.kv_size, self.qkv.kv_size], -1)
        q = rotate_vision(q.reshape(shape), cos, sin)
        k = rotate_vision(k.reshape(shape), cos, sin)
        o = self.attention(q, k, v.reshape(shape), cu_seqlens, self.head_dim**-0.5)
        return self.proj(o.reshape(n, -1))

    def load_fused_qkv(self, param_name: str, loaded: torch.Tensor) -> None:
        """The checkpoint's ``qkv`` stacks all q rows, then k, then v; each is sharded by head."""
        param = getattr(self.qkv, param_name)
        for shard_id, part in zip(("q", "k", "v"), loaded.chunk(3, dim=0)):
            param.weight_loader(param, part.to(param.dtype), shard_id)


class VisionMLP(nn.Module):
    def __init__(self, cfg: PretrainedConfig, dtype: torch.dtype, tp: ParallelGroup,
                 linear: LinearMethod) -> None:
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size,
                                               bias=True, dtype=dtype, tp=tp,
                                               quant_method=linear)
        self.linear_fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True,
                                            dtype=dtype, tp=tp, quant_method=linear)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: PretrainedConfig, dtype: torch.dtype, tp: ParallelGroup,
                 attention: VarlenAttention, linear: LinearMethod) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS, dtype=dtype)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS, dtype=dtype)
        self.attn = VisionAttention(cfg, dtype, tp, attention, linear)
        self.mlp = VisionMLP(cfg, dtype, tp, linear)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """``merge x merge`` neighbouring patches -> one token of the language model's width."""

    def __init__(self, cfg: PretrainedConfig, dtype: torch.dtype, tp: ParallelGroup,
                 norm_after_shuffle: bool, linear: LinearMethod) -> None:
        super().__init__()
        self.merged_size = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm_after_shuffle = norm_after_shuffle
        norm_size = self.merged_size if norm_after_shuffle else cfg.hidden_size
        self.norm = nn.LayerNorm(norm_size, eps=LAYER_NORM_EPS, dtype=dtype)
        self.linear_fc1 = ColumnParallelLinear(self.merged_size, self.merged_size, bias=True,
                                               dtype=dtype, tp=tp, quant_method=linear)
        self.linear_fc2 = RowParallelLinear(self.merged_size, cfg.out_hidden_size, bias=True,
                                            dtype=dtype, tp=tp, quant_method=linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_after_shuffle:
            x = self.norm(x.reshape(-1, self.merged_size))
        else:
            x = self.norm(x).reshape(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))
