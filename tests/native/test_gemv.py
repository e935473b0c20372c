"""The native skinny GEMM (native/csrc/gemv.cpp) against plain PyTorch: float32 within summation
order, bf16 as fp32 sums rounded once, int8 exact; and the seams that route decode-sized GEMMs to
it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.recording_linear import RecordingLinear
from qwenserve.layers.backends import Backends, float_linear_route
from qwenserve.layers.skinny_gemm import with_skinny_gemm
from qwenserve.native.gemm import gemv
from qwenserve.platforms.base import int32_epilogue
from qwenserve.platforms.cpu import CpuPlatform, _cpu_flags
from qwenserve.quantization.kernels import (
    Int8Matmul,
    int8_mm_reference,
    quantize_per_token,
    quantize_weight,
)

KERNEL = gemv()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="native kernels not built here")
# the bf16 path is built for CPUs with AVX512-BF16 (the library is built for the host's ISA)
HAS_BF16_DOT = KERNEL is not None and "avx512_bf16" in _cpu_flags()
needs_bf16 = pytest.mark.skipif(not HAS_BF16_DOT, reason="no AVX512-BF16 on this CPU")
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
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_scaled_equals_the_torch_epilogue(m, n, k, out_dtype, threads):
    """W8A8's GEMM with its scaling in the kernel gives int32_epilogue's values exactly (the
    same fp32 products in the same order, one rounding to bf16), with and without the int32
    bias and the per-token scale."""
    torch.manual_seed(m + n + k)
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) * 1e-3 + 1e-4
    for token_scale in (torch.rand(m, 1) * 0.1 + 0.01, None):
        for bias in (torch.randint(-5000, 5000, (n,), dtype=torch.int32), None):
            got = KERNEL.int8_scaled(x, w, scale, token_scale, bias, out_dtype)
            want = int32_epilogue(KERNEL(x, w), scale, token_scale, bias, out_dtype)
            assert got.dtype == out_dtype and torch.equal(got, want)
    # a layer's float bias, added in the kernel as ``y + bias`` adds it to the scaled y
    layer_bias = torch.randn(n).to(out_dtype)
    got = KERNEL.int8_scaled(x, w, scale, None, None, out_dtype, layer_bias)
    want = int32_epilogue(KERNEL(x, w), scale, None, None, out_dtype) + layer_bias
    assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("m", [1, 3])
def test_float32_bias_is_added_in_the_kernel_as_torch_adds_it(m):
    torch.manual_seed(m)
    x, w, bias = torch.randn(m, 96), torch.randn(40, 96), torch.randn(40)
    assert torch.equal(KERNEL(x, w, bias), KERNEL(x, w).add_(bias))


@needs_kernel
def test_int8_scaled_leaves_what_it_does_not_take_to_the_caller():
    x, w = torch.ones(1, 64, dtype=torch.int8), torch.ones(8, 64, dtype=torch.int8)
    assert KERNEL.int8_scaled(x, w, torch.ones(8), None, None, torch.float16) is None
    assert KERNEL.int8_scaled(x, w, torch.ones(8).double(), None, None, torch.float32) is None
    assert KERNEL.int8_scaled(x, w, torch.ones(8), None, torch.ones(8), torch.float32) is None
    assert KERNEL.int8_scaled(x, w, torch.ones(7), None, None, torch.float32) is None


@needs_bf16
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_bf16_is_fp32_sums_with_the_bias_rounded_once(m, n, k, threads):
    """The products summed in fp32 with the bias, then one rounding to bf16 (as F.linear): all
    but a few elements (sums within fp32 rounding of a bf16 tie) equal that exactly; a second
    rounding for the bias or a truncation would miss many."""
    torch.manual_seed(m * n * k)
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    got = KERNEL(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    exact = (x.double() @ w.double().t() + bias.double()).float().bfloat16()
    torch.testing.assert_close(got.float(), exact.float(), rtol=2**-7, atol=1e-6)
    assert (got == exact).float().mean() >= 0.9
    torch.testing.assert_close(KERNEL(x, w).float(), (x.double() @ w.double().t()).float()
                               .bfloat16().float(), rtol=2**-7, atol=1e-6)


@needs_bf16
def test_bf16_nan_and_inf_propagate():
    x, w = torch.ones(1, 64).bfloat16(), torch.ones(8, 64).bfloat16()
    w[0, 3], w[1, 5] = float("nan"), float("inf")
    got = KERNEL(x, w)
    assert got[0, 0].isnan() and got[0, 1].isinf() and torch.equal(got[0, 2:].float(),
                                                                     torch.full((6,), 64.0))


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
    assert KERNEL.supports(x.bfloat16(), w.bfloat16()) == HAS_BF16_DOT
    assert not KERNEL.supports(x.bfloat16(), w)  # mixed dtypes


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


@needs_bf16
@pytest.mark.parametrize("rows,to_kernel", [(1, True), (2, True), (3, False)])
def test_bf16_rows_have_their_own_limit(rows, to_kernel):
    fallback = RecordingLinear()
    linear = with_skinny_gemm(fallback, 4, 2)
    x, w, b = torch.randn(rows, 96).bfloat16(), torch.randn(40, 96).bfloat16(), torch.randn(40)
    torch.testing.assert_close(linear(x, w, b.bfloat16()).float(),
                               F.linear(x, w, b.bfloat16()).float(), rtol=2**-7, atol=1e-2)
    assert fallback.calls == (0 if to_kernel else 1)
    linear(torch.randn(4, 96), w.float(), b)  # float32 keeps its 4 rows
    assert fallback.calls == (0 if to_kernel else 1)


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
