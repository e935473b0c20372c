"""The native blocked fp32 GEMM (native/csrc/sgemm.cpp) against F.linear in float64: edge tiles
in M (panels of 16 rows with AVX2, 32 with AVX512, whose last panel of at most 16 rows takes a
one-vector tile), N (panels of 6 or 8 weight rows) and K (blocks of up to 1024, vectors of 8),
bias, strided x, both thread counts; and the seam that routes batched GEMMs to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.recording_linear import RecordingLinear
from qwenserve.layers.backends import Backends, float_linear_route
from qwenserve.layers.native_gemm import with_native_gemm
from qwenserve.native.gemm import sgemm
from qwenserve.platforms.cpu import CpuPlatform

KERNEL = sgemm()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="native sgemm not built here")
# (M, N, K): one row; tails of every tile size; K over one block (1025, 2100) and under a vector
SHAPES = [(1, 1, 1), (5, 7, 3), (16, 6, 8), (17, 13, 100), (33, 64, 896), (130, 1152, 67),
          (129, 97, 1025), (300, 250, 2100), (2100, 37, 45), (48, 21, 130), (64, 8, 896),
          (80, 17, 40)]


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
           b: torch.Tensor | None = None) -> None:
    expected = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * x.shape[-1] ** 0.5)


@needs_kernel
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_f_linear(m, n, k, threads):
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    _close(KERNEL(x, w), x, w)
    _close(KERNEL(x, w, b), x, w, b)


@needs_kernel
def test_strided_and_batched_x(threads):
    """Rows of a wider tensor (a view with row stride > K) are read in place; a transposed
    view is copied; leading dims are kept."""
    base, w = torch.randn(40, 300), torch.randn(70, 256)
    view = base[3:, 10:266]
    assert view.stride() == (300, 1)
    _close(KERNEL(view, w), view, w)
    xt = torch.randn(256, 21).t()
    _close(KERNEL(xt, w), xt, w)
    x3 = torch.randn(2, 9, 256)
    got = KERNEL(x3, w)
    assert got.shape == (2, 9, 70)
    _close(got, x3, w)


@needs_kernel
def test_repeated_calls_grow_the_pack_buffer():
    """The packed-x buffer is reused across calls and grown for a larger one: results stay
    right when a small call follows a large one and the other way round."""
    w = torch.randn(30, 500)
    for m in (20, 700, 3, 700, 20):
        x = torch.randn(m, 500)
        _close(KERNEL(x, w), x, w)


@needs_kernel
def test_refusals():
    x, w = torch.randn(8, 64), torch.randn(24, 64)
    assert not KERNEL.supports(x.double(), w.double())
    assert not KERNEL.supports(x.bfloat16(), w.bfloat16())
    assert not KERNEL.supports(x, w.t().contiguous().t())  # not a contiguous [N, K] weight
    assert not KERNEL.supports(torch.randn(0, 64), w)
    assert not KERNEL.supports(torch.randn(8, 32), w)


@needs_kernel
@pytest.mark.parametrize("max_rows", [0, 96])
@pytest.mark.parametrize("rows", [7, 8, 96, 97, 300])
def test_float_linear_routes_batched_rows_to_the_kernel(rows, max_rows):
    fallback = RecordingLinear()
    linear = with_native_gemm(fallback, 8, max_rows)
    to_kernel = rows >= 8 and (max_rows == 0 or rows <= max_rows)
    x, w, b = torch.randn(rows, 96), torch.randn(40, 96), torch.randn(40)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert fallback.calls == (0 if to_kernel else 1)
    assert linear(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16  # other dtypes: fallback
    assert fallback.calls == (1 if to_kernel else 2)
    assert with_native_gemm(fallback, 8, max_rows) is linear  # one function per platform GEMM
    assert with_native_gemm(fallback, 0) is fallback


def test_cpu_backends_use_it_and_reference_does_not():
    platform = CpuPlatform()
    base = platform.float_linear() or torch.nn.functional.linear
    assert Backends.for_platform(platform).float_linear is float_linear_route(platform, base)
    batched = RecordingLinear()  # float32 rows in the native window do not reach the platform
    float_linear_route(platform, batched)(torch.randn(platform.native_gemm_min_rows, 64),
                                          torch.randn(40, 64))
    assert batched.calls == (0 if KERNEL is not None else 1)
    assert Backends.reference().float_linear is F.linear


def test_native_off_keeps_the_platform_gemm(monkeypatch):
    """``QWENSERVE_NATIVE=0`` (or no compiler): the route is the platform GEMM itself."""
    from qwenserve.native import build

    monkeypatch.setenv("QWENSERVE_NATIVE", "0")
    build._load.cache_clear()
    try:
        fallback = RecordingLinear()
        assert with_native_gemm(fallback, 8) is fallback
    finally:
        build._load.cache_clear()
