"""INT8 linear methods (the ``LinearMethod`` protocol of ``layers/linear.py``).

Parameters carry ``output_dim`` / ``input_dim`` like float weights, so the layers' own loaders
shard them over tensor-parallel ranks and place the q/k/v and gate/up shards. Tensors that only
some exporters write are ``optional`` (``check_all_loaded`` does not require them) and start at
zero. Embeddings, norms and ``lm_head`` never come here: they stay float.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from qwenserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    set_dims,
)
from qwenserve.quantization.kernels import (
    Int8Matmul,
    quantize_static,
    quantize_weight,
)

_SHARD_INDEX = {None: 0, "q": 0, "k": 1, "v": 2}


def _param(layer: nn.Module, name: str, tensor: torch.Tensor, output_dim: int | None,
           input_dim: int | None, optional: bool = False) -> nn.Parameter:
    param = nn.Parameter(tensor, requires_grad=False)
    set_dims(param, output_dim=output_dim, input_dim=input_dim)
    param.optional = optional
    layer.register_parameter(name, param)
    return param


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # [num_tokens, in]


class Int8LinearMethod:
    """W8A8 dynamic: int8 weights with one scale per output channel; activations quantized per
    token at run time. compressed-tensors W8A8, ModelSlim W8A8_DYNAMIC and ``--quantization int8``
    share it and differ only in how the weights arrive (``quantize_on_load``: float rows from a
    float checkpoint, quantized as they are loaded, so no float copy of the model is ever held).

    ``zero_point``: the name of an all-zero offset tensor some exporters write for symmetric
    weights (compressed-tensors ``weight_zero_point``, ModelSlim ``weight_offset``); non-zero
    values mean asymmetric weights, which are refused after loading.
    """

    def __init__(self, matmul: Int8Matmul, quantize_on_load: bool = False,
                 zero_point: str | None = None) -> None:
        self.matmul = matmul
        self.quantize_on_load = quantize_on_load
        self.zero_point = zero_point

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype) -> None:
        weight = _param(layer, "weight", torch.empty(output_size, input_size, dtype=torch.int8),
                        output_dim=0, input_dim=1)  # [out, in]
        _param(layer, "weight_scale", torch.ones(output_size, 1),  # [out, 1] float32
               output_dim=0, input_dim=None, optional=self.quantize_on_load)
        loader = _load_quantizing if self.quantize_on_load else _load_int8
        weight.weight_loader = functools.partial(loader, layer)
        if self.zero_point is not None:
            _param(layer, self.zero_point, torch.zeros(output_size, 1),  # [out, 1]
                   output_dim=0, input_dim=None, optional=True)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        x_q, token_scale = self.matmul.quantize(_flat(x))  # [T, in] int8, [T, 1]
        y = self.matmul(x_q, layer.weight, layer.weight_scale.view(-1), token_scale, None,
                        x.dtype, bias)  # [T, out]
        return y.view(*x.shape[:-1], -1)

    def process_weights(self, layer: nn.Module) -> None:
        if self.zero_point is not None:
            zero = getattr(layer, self.zero_point)
            if zero.abs().max().item() != 0:
                raise ValueError(f"{self.zero_point} of a quantized layer is not zero "
                                 "(asymmetric int8 weights); qwenserve runs symmetric weights "
                                 "only: export with symmetric weights")
            layer.register_parameter(self.zero_point, None)  # checked; not needed any more


def int8_mlp(gate_up: MergedColumnParallelLinear, down: RowParallelLinear,
             x: torch.Tensor) -> torch.Tensor | None:
    """``down(silu_and_mul(gate_up(x)))`` of a W8A8 (dynamic) MLP with its middle fused: the
    gate_up GEMM's float32 result goes through its per-token scale, SiLU-and-mul and the down
    projection's per-token quantization in one pass (``RowQuantizer.silu_mul_quantize``), where
    the plain path writes and reads two tensors and makes three calls; with the packed VNNI
    kernel the SiLU-and-mul is in the GEMM's epilogue (``Int8Matmul.gate_up_silu``) and one
    quantizing pass follows. The same integers and scales reach the down GEMM. None where this
    does not apply (other methods, a gate_up bias, rows that the plain path computes another
    way, no native kernel): the caller runs the plain path."""
    up_method, down_method = gate_up.quant_method, down.quant_method
    if not (isinstance(up_method, Int8LinearMethod) and isinstance(down_method, Int8LinearMethod)
            and gate_up.bias is None and x.dim() == 2):
        return None
    matmul = up_method.matmul
    fused = matmul.packed is not None and matmul.quantizer is not None
    if not (fused or matmul.scales_apart(x.shape[0])) or not matmul.quantizer.supports(x):
        return None
    x_q, token_scale = matmul.quantize(x)
    # the packed VNNI kernel: the GEMM and its SiLU-and-mul in one (no [rows, 2I] float32
    # intermediate), then the down input's quantization, to the same integers
    mid = matmul.gate_up_silu(x_q, gate_up.weight, gate_up.weight_scale.view(-1), token_scale,
                              x.dtype) if fused else None
    if mid is not None:
        rows = matmul.quantize(mid)
    else:
        acc = matmul.accumulate(x_q, gate_up.weight, gate_up.weight_scale.view(-1), None)
        rows = (None if acc is None
                else matmul.quantizer.silu_mul_quantize(acc, token_scale, x.dtype))
    if rows is None:
        return None
    y_q, y_scale = rows
    y = down_method.matmul(y_q, down.weight, down.weight_scale.view(-1), y_scale, None, x.dtype)
    return down.reduce(y)


def _load_int8(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
               shard_id: Any = None) -> None:
    """An int8 weight must arrive as int8: a float one means the quantization config and the
    tensors disagree (e.g. a layer the config quantizes but the exporter left float)."""
    if loaded.dtype != torch.int8:
        raise ValueError(f"the quantization config marks this {type(layer).__name__} as INT8 but "
                         f"the checkpoint holds a {loaded.dtype} weight for it (shard "
                         f"{shard_id}); the checkpoint's config does not match its tensors")
    layer.weight_loader(param, loaded, shard_id)


def _load_quantizing(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: Any = None) -> None:
    """Quantize one checkpoint tensor (a whole weight or one q/k/v shard) and hand the int8
    rows and their scales to the layer's loader, which shards and places both alike."""
    if not loaded.is_floating_point():
        raise ValueError(f"--quantization int8 quantizes float weights, but the checkpoint holds "
                         f"{loaded.dtype} ones; remove the flag")
    weight_q, scale = quantize_weight(loaded)  # [rows, in] int8, [rows, 1] float32
    layer.weight_loader(param, weight_q, shard_id)
    layer.weight_loader(layer.weight_scale, scale, shard_id)


class AscendW8A8StaticMethod:
    """ModelSlim W8A8 (vLLM Ascend's ``AscendW8A8LinearMethod``) in plain PyTorch.

    Activations: static per-tensor int8 with a zero point, x_q = round(x / input_scale +
    input_offset). Output: (x_q @ W.T + quant_bias) * deq_scale, where ModelSlim stored
    deq_scale = input_scale * weight_scale and quant_bias = round(bias / deq_scale -
    input_offset * W.sum(1)): the float bias and the zero-point correction live in quant_bias.
    Row-parallel layers add quant_bias on rank 0 only (the all-reduce sums the partial products).
    """

    def __init__(self, matmul: Int8Matmul) -> None:
        self.matmul = matmul

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype) -> None:
        weight = _param(layer, "weight", torch.empty(output_size, input_size, dtype=torch.int8),
                        output_dim=0, input_dim=1)  # [out, in]
        weight.weight_loader = functools.partial(_load_int8, layer)
        deq = _param(layer, "deq_scale", torch.empty(output_size),  # [out] float32
                     output_dim=0, input_dim=None)
        deq.weight_loader = functools.partial(_load_deq_scale, layer)
        _param(layer, "quant_bias", torch.zeros(output_size, dtype=torch.int32),  # [out]
               output_dim=0, input_dim=None)
        num_shards = len(_shard_sizes(layer))
        for name in ("input_scale", "input_offset"):  # one value per q/k/v or gate/up shard
            per_shard = _param(layer, name, torch.zeros(num_shards), None, None)  # [shards]
            per_shard.weight_loader = _load_per_shard
        for name in ("weight_scale", "weight_offset"):  # folded into deq_scale; not needed
            _param(layer, name, torch.zeros(output_size, 1), output_dim=0, input_dim=None,
                   optional=True)

    def process_weights(self, layer: nn.Module) -> None:
        layer.act_groups = _act_groups(layer)
        if layer.bias is not None:  # already inside quant_bias
            layer.bias = None
        for name in ("input_scale", "input_offset", "weight_scale", "weight_offset"):
            layer.register_parameter(name, None)  # folded into act_groups / deq_scale

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        x2 = _flat(x)  # [T, in]
        add_bias = not (isinstance(layer, RowParallelLinear) and layer.tp.rank != 0)
        outs = []
        for start, end, inv_scale, offset in layer.act_groups:
            rows = slice(start, end)
            outs.append(self.matmul(quantize_static(x2, inv_scale, offset), layer.weight[rows],
                                    layer.deq_scale[rows], None,
                                    layer.quant_bias[rows] if add_bias else None, x.dtype))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)  # [T, out]
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], -1)


def _load_deq_scale(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: Any = None) -> None:
    """ModelSlim stores deq_scale as float32 for bf16 models and, for fp16 models, as int64
    holding the float32 bit pattern (what the Ascend kernel reads); decode the latter."""
    if not loaded.is_floating_point():
        loaded = loaded.to(torch.int32).view(torch.float32)
    layer.weight_loader(param, loaded.float(), shard_id)


def _load_per_shard(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    index = shard_id if isinstance(shard_id, int) else _SHARD_INDEX.get(shard_id)
    if index is None or index >= param.shape[0]:
        raise ValueError(f"ModelSlim W8A8 static activation scales are supported for q/k/v, "
                         f"gate/up and single projections, not for shard {shard_id!r}")
    param.data[index] = loaded.reshape(()).float()


def _shard_sizes(layer: nn.Module) -> list[int]:
    """Rows of each checkpoint shard in this rank's matrix (q/k/v, gate/up, or one)."""
    if isinstance(layer, QKVParallelLinear):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(layer.output_sizes)
    return [layer.output_size]


def _act_groups(layer: nn.Module) -> list[tuple[int, int, float, float]]:
    """(first row, end row, 1 / input_scale, input_offset) runs of shards that quantize their
    input alike: one run in practice (q, k and v see the same activations, so ModelSlim
    calibrates the same values); more only when the shards were calibrated apart."""
    groups: list[tuple[int, int, float, float]] = []
    start = 0
    for i, rows in enumerate(_shard_sizes(layer)):
        scale, offset = layer.input_scale[i].item(), layer.input_offset[i].item()
        if scale <= 0:
            raise ValueError(f"input_scale of shard {i} is {scale}; the checkpoint is incomplete")
        if groups and groups[-1][2:] == (1.0 / scale, offset):
            groups[-1] = (groups[-1][0], start + rows, 1.0 / scale, offset)
        else:
            groups.append((start, start + rows, 1.0 / scale, offset))
        start += rows
    return groups
