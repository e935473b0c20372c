"""The W8A8 MLP's fused middle (``quantization.methods.int8_mlp``): the gate_up GEMM's result goes
through its token scale, SiLU-and-mul and the down projection's quantization in one native pass.
It must give the plain path's numbers exactly, and run only where the plain path would scale
per token apart from the GEMM (more than one row, the platform's GEMM and the native kernels)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from qwenserve.layers.backends import Backends
from qwenserve.models.base import ModelContext
from qwenserve.models.dense import MLP
from qwenserve.native.elementwise import elementwise
from qwenserve.platforms.cpu import CpuPlatform
from qwenserve.quantization import methods
from qwenserve.quantization.kernels import Int8Matmul
from qwenserve.quantization.quant_config import LoadTimeInt8Config

HIDDEN, INTER = 64, 200


def _int8_mlp(matmul: Int8Matmul, dtype: torch.dtype) -> MLP:
    cfg = Qwen2Config(hidden_size=HIDDEN, intermediate_size=INTER)
    ctx = ModelContext(cfg, dtype, 64, backends=Backends.for_platform(CpuPlatform()),
                       quant=LoadTimeInt8Config(matmul))
    mlp = MLP(ctx, INTER, False, "model.layers.0.mlp")
    gen = torch.Generator().manual_seed(3)
    for shard in (0, 1):  # gate, up: float rows, quantized as they load
        mlp.gate_up_proj.weight.weight_loader(mlp.gate_up_proj.weight,
                                              torch.randn(INTER, HIDDEN, generator=gen), shard)
    mlp.down_proj.weight.weight_loader(mlp.down_proj.weight,
                                       torch.randn(HIDDEN, INTER, generator=gen))
    return mlp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_fused_middle_gives_the_plain_paths_numbers(monkeypatch, dtype, rows):
    if elementwise() is None:
        pytest.skip("no C++ compiler: no native kernels")
    mlp = _int8_mlp(Int8Matmul(CpuPlatform(), quantizer=elementwise()), dtype)
    x = (torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)
    fused_calls = []
    real = methods.int8_mlp
    monkeypatch.setattr("qwenserve.models.dense.int8_mlp",
                        lambda *a: (lambda y: fused_calls.append(y is not None) or y)(real(*a)))
    got = mlp(x)
    monkeypatch.setattr("qwenserve.models.dense.int8_mlp", lambda *a: None)
    want = mlp(x)
    assert got.dtype == dtype and got.shape == (rows, HIDDEN)
    assert torch.equal(got, want)
    matmul = mlp.gate_up_proj.quant_method.matmul
    assert fused_calls == [matmul.scales_apart(rows)]  # taken exactly where it applies
    assert matmul.scales_apart(rows) == (rows > 1 and matmul.skinny_rows < rows)


def test_no_fusion_without_the_native_quantizer_or_for_float_layers():
    x = torch.randn(5, HIDDEN)
    plain = _int8_mlp(Int8Matmul(CpuPlatform()), torch.float32)  # no quantizer: torch ops
    assert methods.int8_mlp(plain.gate_up_proj, plain.down_proj, x) is None
    cfg = Qwen2Config(hidden_size=HIDDEN, intermediate_size=INTER)
    float_mlp = MLP(ModelContext(cfg, torch.float32, 64), INTER, False, "mlp")
    assert methods.int8_mlp(float_mlp.gate_up_proj, float_mlp.down_proj, x) is None
