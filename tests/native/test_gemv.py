"""The native skinny GEMM (native/csrc/gemv.cpp) against plain PyTorch: float32 within summation
order, int8 exact; and the seams that route decode-sized GEMMs to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.recording_linear import RecordingLinear
from qwenserve.layers.backends import Backends, float_linear_route
from qwenserve.layers.skinny_gemm import with_skinny_gemm
from qwenserve.native.kernels import gemv
from qwenserve.platforms.cpu import CpuPlatform
from qwenserve.quantization.kernels import (
    Int8Matmul,
    int8_mm_reference,
    quantize_per_token,
    quantize_weight,
)

KERNEL = gemv()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="native kernels not built here")
# (rows of x, N, K): tails in N (blocks of 4 rows) and K (vectors of 8/16), 1-9 rows (passes of 4)
# K past the 32-wide (AVX512), 16-wide (AVX2) and scalar steps: 48 = 32 + 16, 113 = 3 x 32 + 16 + 1
SHAPES = [(1, 1, 1), (1, 5, 13), (2, 33, 100), (3, 64, 896), (4, 1152, 896), (5, 7, 4864),
          (9, 130, 67), (2, 9, 48), (1, 3, 113)]


@needs_kernel
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_float32_matches_f_linear(m, n, k, threads):
    x, w = torch.randn(m, k), torch.randn(n, k)
    expected = F.linear(x.double(), w.double()).float()
    torch.testing.assert_close(KERNEL(x, w), expected, rtol=1e-5, atol=1e-4 * k**0.5)


@needs_kernel
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_is_exact(m, n, k, threads):
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    got = KERNEL(x, w)
    assert got.dtype == torch.int32
    assert torch.equal(got, (x.long() @ w.long().t()).int())


@needs_kernel
def test_extremes_do_not_overflow():
    """-128 * -128 summed over 4864 inputs (the down projection's K) fits int32 exactly."""
    x = torch.full((1, 4864), -128, dtype=torch.int8)
    assert KERNEL(x, x.clone()).item() == 4864 * 128 * 128


@needs_kernel
def test_leading_dims_and_refusals():
    x, w = torch.randn(2, 1, 64), torch.randn(24, 64)
    assert KERNEL(x, w).shape == (2, 1, 24)
    assert not KERNEL.supports(x.double(), w.double())
    assert not KERNEL.supports(x, w.t().contiguous().t())  # not a contiguous [N, K] weight
    assert not KERNEL.supports(x.bfloat16(), w.bfloat16())


@needs_kernel
@pytest.mark.parametrize("rows,to_kernel", [(1, True), (4, True), (5, False)])
def test_float_linear_routes_decode_rows_to_the_kernel(rows, to_kernel):
    fallback = RecordingLinear()
    linear = with_skinny_gemm(fallback, 4)
    x, w, b = torch.randn(rows, 96), torch.randn(40, 96), torch.randn(40)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert fallback.calls == (0 if to_kernel else 1)
    assert linear(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16  # other dtypes: fallback
    assert with_skinny_gemm(fallback, 4) is linear  # one function per platform GEMM


def test_cpu_backends_use_it_and_reference_does_not():
    platform = CpuPlatform()
    base = platform.float_linear() or F.linear
    assert Backends.for_platform(platform).float_linear is float_linear_route(platform, base)
    decode = RecordingLinear()  # float32 decode rows do not reach the platform GEMM
    float_linear_route(platform, decode)(torch.randn(2, 64), torch.randn(40, 64))
    assert decode.calls == (0 if KERNEL is not None else 1)
    assert Backends.reference().float_linear is F.linear
    assert with_skinny_gemm(F.linear, 0) is F.linear


@pytest.mark.parametrize("rows", [1, 3, 4, 6])
def test_int8_matmul_equals_the_reference(rows):
    """Whatever route the platform takes (native kernel or oneDNN), the W8A8 result is the
    dequantizing reference's up to fp32 rounding."""
    x, w = torch.randn(rows, 200), torch.randn(72, 200)
    x_q, token_scale = quantize_per_token(x)
    w_q, scale = quantize_weight(w)
    bias = torch.randint(-1000, 1000, (72,), dtype=torch.int32)
    got = Int8Matmul(CpuPlatform())(x_q, w_q, scale.view(-1), token_scale, bias, torch.float32)
    ref = int8_mm_reference(x_q, w_q, scale.view(-1), token_scale, bias, torch.float32)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
