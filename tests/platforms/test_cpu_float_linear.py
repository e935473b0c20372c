"""The CPU platform's float GEMM (oneDNN) agrees with F.linear, and a loaded model uses it (with
decode rows through the native skinny GEMM) in every float linear layer and its LM head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwenserve import LLM
from qwenserve.layers.backends import float_linear_route
from qwenserve.layers.embedding import ParallelLMHead
from qwenserve.layers.linear import LinearBase
from qwenserve.platforms.cpu import CpuPlatform


@pytest.mark.parametrize("shape", [(1, 64, 32), (3, 5, 64, 48), (17, 896, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(shape, bias):
    linear = CpuPlatform().float_linear()
    if linear is None:
        pytest.skip("this torch build has no oneDNN linear")
    *lead, k, n = shape
    x, w = torch.randn(*lead, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_work_on_any_cpu(dtype):
    """bf16/fp16 models run through the same function (oneDNN has no bf16 inner product on
    CPUs without AVX512-BF16/AMX, and raised there: `--dtype bfloat16` failed to start)."""
    linear = CpuPlatform().float_linear() or F.linear
    x, w, b = (torch.randn(5, 64).to(dtype), torch.randn(48, 64).to(dtype),
               torch.randn(48).to(dtype))
    got = linear(x, w, b)
    assert got.dtype == dtype
    torch.testing.assert_close(got, F.linear(x, w, b))


def test_model_layers_use_the_platform_linear(tiny_model):
    linear = CpuPlatform().float_linear()
    llm = LLM(tiny_model("qwen3"), dtype="float32", max_model_len=64)
    model = llm.llm_engine.executor.worker.model
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    assert layers and heads
    expected = float_linear_route(CpuPlatform(), linear or F.linear)
    assert all(m.quant_method.linear is expected for m in layers)
    assert all(h.float_linear is expected for h in heads)
