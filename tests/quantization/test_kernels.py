"""INT8 primitives and linear methods on single layers: the CPU int8 GEMM equals the
dequantizing reference, and each method reproduces the float layer within quantization error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from quant_writers import _static_tensors, quantize_channels

from qwenserve.layers.linear import QKVParallelLinear, RowParallelLinear
from qwenserve.platforms.cpu import CpuPlatform
from qwenserve.quantization.kernels import (
    Int8Matmul,
    int8_mm_reference,
    quantize_per_token,
    quantize_weight,
)
from qwenserve.quantization.quant_config import LoadTimeInt8Config, ModelSlimConfig

# Relative error of one int8 W8A8 linear layer (per-channel weights, per-token activations) on
# Gaussian data: ~0.5% expected (two roundings of ~1/254 of the range each); 2% bounds it.
LAYER_REL_TOL = 0.02


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_quantize_per_token_error_is_half_a_step():
    x = torch.randn(7, 96) * torch.linspace(0.1, 10, 7)[:, None]
    x_q, scale = quantize_per_token(x)
    assert x_q.dtype == torch.int8 and scale.shape == (7, 1)
    assert ((x_q.float() * scale - x).abs() <= scale / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 3, 33])
def test_cpu_int8_gemm_equals_reference(rows):
    gen = torch.Generator().manual_seed(rows)
    a = torch.randint(-128, 128, (rows, 200), generator=gen, dtype=torch.int8)
    w = torch.randint(-127, 128, (48, 200), generator=gen, dtype=torch.int8)
    scale, token_scale = torch.rand(48) + 0.5, torch.rand(rows, 1) + 0.5
    bias = torch.randint(-1000, 1000, (48,), generator=gen, dtype=torch.int32)
    got = CpuPlatform().int8_scaled_mm(a, w, scale, token_scale, bias, torch.float32)
    want = int8_mm_reference(a, w, scale, token_scale, bias, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-3)
    exact = (a.long() @ w.long().t() + bias).float() * scale * token_scale
    torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-3)


def qkv_layer(quant) -> QKVParallelLinear:
    return QKVParallelLinear(64, 16, 4, 2, bias=False,
                             quant_method=quant.linear_method("model.layers.0.self_attn.qkv_proj"))


def test_load_time_int8_quantizes_each_shard_as_it_arrives():
    torch.manual_seed(0)
    q, k, v = torch.randn(64, 64), torch.randn(32, 64), torch.randn(32, 64)
    layer = qkv_layer(LoadTimeInt8Config(Int8Matmul(CpuPlatform())))
    for shard_id, w in zip("qkv", (q, k, v), strict=True):
        layer.weight.weight_loader(layer.weight, w, shard_id)
    whole_q, whole_scale = quantize_weight(torch.cat([q, k, v]))
    assert torch.equal(layer.weight, whole_q) and torch.equal(layer.weight_scale, whole_scale)
    x = torch.randn(5, 64)
    assert rel_err(layer(x), F.linear(x, torch.cat([q, k, v]))) < LAYER_REL_TOL


def test_fallback_without_int8_gemm_gives_the_same_output():
    torch.manual_seed(1)
    layer = qkv_layer(LoadTimeInt8Config(Int8Matmul(CpuPlatform())))
    for shard_id, rows in zip("qkv", (64, 32, 32), strict=True):
        layer.weight.weight_loader(layer.weight, torch.randn(rows, 64), shard_id)
    x = torch.randn(9, 64)
    fast = layer(x)
    layer.quant_method.matmul = Int8Matmul(None)  # a platform without an int8 GEMM
    torch.testing.assert_close(layer(x), fast, rtol=1e-5, atol=1e-5)


def modelslim_qkv(ranges, int64_deq=False):
    """A ModelSlim W8A8 q/k/v layer loaded through the layer loaders, plus its float weights."""
    desc = {f"model.layers.0.self_attn.{p}_proj.weight": "W8A8" for p in "qkv"}
    layer = qkv_layer(ModelSlimConfig(desc, Int8Matmul(CpuPlatform())))
    weights = {p: torch.randn(rows, 64) for p, rows in zip("qkv", (64, 32, 32), strict=True)}
    biases = {p: torch.randn(w.shape[0]) for p, w in weights.items()}
    for p in "qkv":
        tensors = _static_tensors(p, weights[p], biases[p], ranges[p], int64_deq)
        for name, tensor in tensors.items():
            param = getattr(layer, name.split(".", 1)[1])
            param.weight_loader(param, tensor.float() if tensor.is_floating_point() else tensor,
                                p)
    return layer, torch.cat(list(weights.values())), torch.cat(list(biases.values()))


@pytest.mark.parametrize("int64_deq", [False, True])
@pytest.mark.parametrize("same_ranges", [True, False])
def test_modelslim_static_w8a8_layer(int64_deq, same_ranges):
    torch.manual_seed(2)
    x = torch.randn(6, 64) * 1.5 + 0.3  # asymmetric range: exercises input_offset
    full = (x.min().item(), x.max().item())
    ranges = {p: full for p in "qkv"} if same_ranges else {
        "q": full, "k": (full[0] * 1.2, full[1] * 1.1), "v": (full[0] * 1.5, full[1])}
    layer, weight, bias = modelslim_qkv(ranges, int64_deq)
    layer.quant_method.process_weights(layer)
    assert len(layer.act_groups) == (1 if same_ranges else 3)  # shards calibrated apart
    assert rel_err(layer(x), F.linear(x, weight, bias)) < LAYER_REL_TOL


def test_modelslim_row_parallel_adds_quant_bias_on_rank_zero_only():
    desc = {"model.layers.0.self_attn.o_proj.weight": "W8A8"}
    layer = RowParallelLinear(64, 32, quant_method=ModelSlimConfig(desc, Int8Matmul(CpuPlatform()))
                              .linear_method("model.layers.0.self_attn.o_proj"))
    torch.manual_seed(3)
    weight, bias, x = torch.randn(32, 64), torch.randn(32), torch.randn(4, 64)
    for name, tensor in _static_tensors("o", weight, bias, (-4.0, 4.0), False).items():
        param = getattr(layer, name.split(".", 1)[1])
        param.weight_loader(param, tensor)
    layer.quant_method.process_weights(layer)
    assert rel_err(layer(x), F.linear(x, weight, bias)) < LAYER_REL_TOL
    layer.tp = SimpleNamespace(rank=1, world_size=2, all_reduce=lambda y: y)  # as rank 1
    assert rel_err(layer(x), F.linear(x, weight)) < LAYER_REL_TOL


def test_writer_quantization_matches_the_loader():
    w = torch.randn(16, 40, generator=torch.Generator().manual_seed(4))
    assert torch.equal(quantize_channels(w)[0], quantize_weight(w)[0])
