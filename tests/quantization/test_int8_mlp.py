"""The W8A8 MLP's fused middle (``quantization.methods.int8_mlp``): the gate_up GEMM's result goes
through its token scale, SiLU-and-mul and the down projection's quantization in one native pass.
It must give the plain path's numbers exactly, and run only where the plain path would scale
per token apart from the GEMM (more than one row, the platform's GEMM and the native kernels),
or, on VNNI CPUs without AMX, at every row count with the packed int8 GEMM's SiLU-and-mul in its
epilogue (tests/native/test_pigemm.py checks that kernel's bits)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from qwenserve.layers.backends import Backends
from qwenserve.models.base import ModelContext
from qwenserve.models.dense import MLP
from qwenserve.native.elementwise import elementwise
from qwenserve.native.gemm import Pigemm
from qwenserve.platforms.cpu import CpuPlatform
from qwenserve.quantization import methods
from qwenserve.quantization.kernels import Int8Matmul
from qwenserve.quantization.quant_config import LoadTimeInt8Config

HIDDEN, INTER = 64, 200


def _int8_mlp(matmul: Int8Matmul, dtype: torch.dtype, inter: int = INTER) -> MLP:
    cfg = Qwen2Config(hidden_size=HIDDEN, intermediate_size=inter)
    ctx = ModelContext(cfg, dtype, 64, backends=Backends.for_platform(CpuPlatform()),
                       quant=LoadTimeInt8Config(matmul))
    mlp = MLP(ctx, inter, False, "model.layers.0.mlp")
    gen = torch.Generator().manual_seed(3)
    for shard in (0, 1):  # gate, up: float rows, quantized as they load
        mlp.gate_up_proj.weight.weight_loader(mlp.gate_up_proj.weight,
                                              torch.randn(inter, HIDDEN, generator=gen), shard)
    mlp.down_proj.weight.weight_loader(mlp.down_proj.weight,
                                       torch.randn(HIDDEN, inter, generator=gen))
    return mlp


@pytest.mark.parametrize("inter", [INTER, 128])  # 128: the packed kernel's SiLU-and-mul takes it
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_fused_middle_gives_the_plain_paths_numbers(monkeypatch, dtype, rows, inter):
    if elementwise() is None:
        pytest.skip("no C++ compiler: no native kernels")
    mlp = _int8_mlp(Int8Matmul(CpuPlatform(), quantizer=elementwise()), dtype, inter)
    x = (torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)
    fused_calls, kernel_calls = [], []
    real_silu_mul = Pigemm.silu_mul
    monkeypatch.setattr(Pigemm, "silu_mul", lambda self, *a: (
        lambda y: kernel_calls.append(y is not None) or y)(real_silu_mul(self, *a)))
    real = methods.int8_mlp
    monkeypatch.setattr("qwenserve.models.dense.int8_mlp",
                        lambda *a: (lambda y: fused_calls.append(y is not None) or y)(real(*a)))
    got = mlp(x)
    monkeypatch.setattr("qwenserve.models.dense.int8_mlp", lambda *a: None)
    want = mlp(x)
    assert got.dtype == dtype and got.shape == (rows, HIDDEN)
    assert torch.equal(got, want)
    matmul = mlp.gate_up_proj.quant_method.matmul
    # taken exactly where it applies: at every row count with the packed VNNI kernel (its
    # SiLU-and-mul in the GEMM where I % 64 == 0), else where the GEMM scales apart
    assert fused_calls == [matmul.packed is not None or matmul.scales_apart(rows)]
    assert matmul.scales_apart(rows) == (rows > 1 and matmul.skinny_rows < rows)
    assert any(kernel_calls) == (matmul.packed is not None and inter % 64 == 0)


def test_no_fusion_without_the_native_quantizer_or_for_float_layers():
    x = torch.randn(5, HIDDEN)
    plain = _int8_mlp(Int8Matmul(CpuPlatform()), torch.float32)  # no quantizer: torch ops
    assert methods.int8_mlp(plain.gate_up_proj, plain.down_proj, x) is None
    cfg = Qwen2Config(hidden_size=HIDDEN, intermediate_size=INTER)
    float_mlp = MLP(ModelContext(cfg, torch.float32, 64), INTER, False, "mlp")
    assert methods.int8_mlp(float_mlp.gate_up_proj, float_mlp.down_proj, x) is None
