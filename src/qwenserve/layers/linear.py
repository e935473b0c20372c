"""Linear layers that know their tensor-parallel shard and how to load it.

Each parameter carries a ``weight_loader`` and marks which of its dims is the output
(``output_dim``) and input (``input_dim``) dimension, so quantized parameters (int8 weights,
per-channel scales) shard with the same code as float weights.

    ColumnParallel: W [out, in] split by rows   -> each rank computes out/tp features
    RowParallel:    W [out, in] split by columns -> partial sums, all-reduced
    QKV / Merged:   several column-parallel matrices stacked in one GEMM
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.distributed.parallel_group import SINGLE, ParallelGroup

# which part of a merged weight a checkpoint tensor is: an output index (gate/up) or "q"/"k"/"v"
ShardId = int | str | None


class LinearMethod(Protocol):
    """How a linear layer stores its weight and computes ``x @ W.T`` (float, int8, ...)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype) -> None: ...

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor: ...


class UnquantizedLinearMethod:
    def __init__(self, linear: Callable[..., torch.Tensor] = F.linear) -> None:
        self.linear = linear  # the platform's float GEMM (``Backends.float_linear``)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                              requires_grad=False)  # [out, in]
        set_dims(weight, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return self.linear(x, layer.weight, bias)


def set_dims(param: nn.Parameter, output_dim: int | None, input_dim: int | None) -> None:
    param.output_dim = output_dim
    param.input_dim = input_dim


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str = "") -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name or ''} has shape {tuple(src.shape)} in the checkpoint "
                         f"but the model expects {tuple(dst.shape)}; does config.json match "
                         "the weights?")
    dst.copy_(src)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 tp: ParallelGroup, quant_method: LinearMethod | None) -> None:
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size  # per rank
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, output_size, dtype)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype), requires_grad=False)
            set_dims(self.bias, output_dim=0, input_dim=None)
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            # A quant method may give a parameter its own loader (e.g. one that quantizes float
            # rows as they arrive); it calls back into this layer's loader for the sharding.
            param.weight_loader = getattr(param, "weight_loader", None) or self.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        copy_checked(param.data, loaded)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, quant_method: LinearMethod | None = None):
        super().__init__(input_size, output_size, bias, dtype, SINGLE, quant_method)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp: ParallelGroup = SINGLE,
                 quant_method: LinearMethod | None = None):
        super().__init__(input_size, tp.shard(output_size, "output features"), bias, dtype, tp,
                         quant_method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is not None and self.tp.world_size > 1:
            size = param.shape[dim]
            loaded = loaded.narrow(dim, self.tp.rank * size, size)
        copy_checked(param.data, loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix, e.g. ``gate_proj`` and ``up_proj``."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp: ParallelGroup = SINGLE,
                 quant_method: LinearMethod | None = None):
        self.output_sizes = [tp.shard(s, "output features") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, dtype, tp, quant_method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:  # a per-tensor value shared by the shards (e.g. a scalar scale)
            copy_checked(param.data, loaded)
            return
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        loaded = loaded.narrow(dim, self.tp.rank * size, size)
        copy_checked(param.data.narrow(dim, offset, size), loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix. KV heads are split over ranks, or replicated when
    there are fewer KV heads than ranks (rank r then holds KV head ``r * num_kv_heads // tp``)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype = torch.float32,
                 tp: ParallelGroup = SINGLE, quant_method: LinearMethod | None = None,
                 q_head_multiplier: int = 1):
        self.head_dim = head_dim
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.world_size:
            self.num_kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            if tp.world_size % num_kv_heads:
                raise ValueError(f"--tensor-parallel-size {tp.world_size} must be a multiple of "
                                 f"num_key_value_heads ({num_kv_heads}) when it is larger")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.world_size
        # q_head_multiplier 2: Qwen3.5 stores [q | gate] per head in q_proj.
        self.q_size = self.num_heads * head_dim * q_head_multiplier
        self.kv_size = self.num_kv_heads * head_dim
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias, dtype, tp,
                            quant_method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:
            copy_checked(param.data, loaded)
            return
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        else:
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        copy_checked(param.data.narrow(dim, offset, size), loaded.narrow(dim, start, size))


class RowParallelLinear(LinearBase):
    """Input split over ranks; the partial products are all-reduced (one collective)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp: ParallelGroup = SINGLE,
                 quant_method: LinearMethod | None = None):
        super().__init__(tp.shard(input_size, "input features"), output_size, bias, dtype, tp,
                         quant_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.quant_method.apply(self, x, None))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's partial product: all-reduced, then the bias."""
        y = self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is not None and self.tp.world_size > 1:
            size = param.shape[dim]
            loaded = loaded.narrow(dim, self.tp.rank * size, size)
        copy_checked(param.data, loaded)
