"""The AMX bf16 GEMM for small batches (native/csrc/bgemm.cpp) against a float64 reference of the
same bf16 operands: one rounding of fp32 sums, so within a bf16 unit of the exact result. Edge
cases: 16-row blocks of x (one or two a pass, a last partial one, several passes past 32 rows),
32-row weight panels split between threads (each pass prefetching the next panel's rows), K of
one to many 32-steps, bias, strided x; the refusals; and the seam that routes small bf16 batches
to it. Skipped where the CPU (or the
process) has no AMX tiles: the route is then the platform GEMM itself (tested below too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.recording_linear import RecordingLinear
from qwenserve.layers.backends import Backends, float_linear_route
from qwenserve.layers.native_gemm import with_amx_gemm
from qwenserve.native.gemm import bgemm
from qwenserve.platforms.cpu import CpuPlatform

KERNEL = bgemm()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no AMX tiles here")
# (M, N, K): one row; a partial block; one and two blocks; a pass and a bit; several passes
SHAPES = [(1, 32, 32), (7, 64, 96), (16, 32, 64), (17, 96, 128), (32, 1152, 896),
          (33, 64, 1024), (64, 896, 4864), (96, 1152, 896), (100, 160, 320)]


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
           b: torch.Tensor | None = None) -> None:
    """Within one bf16 rounding of the exact result (plus fp32 summation error)."""
    assert got.dtype == torch.bfloat16
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T  # the sums' magnitude, for the fp32 error
    err = (got.double() - exact).abs()
    assert bool((err <= exact.abs() * 2.0 ** -8 + scale * 1e-6 + 1e-30).all()), err.max()


def _operands(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(m, k).bfloat16(), (torch.randn(n, k) / k ** 0.5).bfloat16(),
            torch.randn(n).bfloat16())


@needs_kernel
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_the_exact_product(m, n, k, threads):
    x, w, b = _operands(m, n, k)
    _close(KERNEL(x, w), x, w)
    _close(KERNEL(x, w, b), x, w, b)


@needs_kernel
def test_agrees_with_f_linear_in_bf16():
    """Against torch's own bf16 GEMM (which the platform would run): the same value or one bf16
    unit apart (the two sum in different orders before their one rounding)."""
    x, w, b = _operands(24, 1152, 896)
    got, ref = KERNEL(x, w, b).float(), F.linear(x, w, b).float()
    torch.testing.assert_close(got, ref, rtol=2.0 ** -7, atol=1e-3)


@needs_kernel
def test_strided_and_batched_x():
    """Rows of a wider tensor (a view with row stride > K) are read in place; a transposed view
    is copied; leading dims are kept."""
    base, w = torch.randn(40, 300).bfloat16(), torch.randn(64, 256).bfloat16()
    view = base[3:, 10:266]
    assert view.stride() == (300, 1)
    _close(KERNEL(view, w), view, w)
    xt = torch.randn(256, 21).bfloat16().t()
    _close(KERNEL(xt, w), xt, w)
    x3 = torch.randn(2, 9, 256).bfloat16()
    got = KERNEL(x3, w)
    assert got.shape == (2, 9, 64)
    _close(got, x3, w)


@needs_kernel
def test_repeated_calls_grow_the_pack_buffer():
    w = torch.randn(64, 512).bfloat16()
    for m in (3, 90, 1, 90, 20):
        x = torch.randn(m, 512).bfloat16()
        _close(KERNEL(x, w), x, w)


@needs_kernel
def test_refusals():
    x, w = torch.randn(8, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    assert KERNEL.supports(x, w)
    assert not KERNEL.supports(x.float(), w.float())
    assert not KERNEL.supports(x, torch.randn(48, 64).bfloat16())  # N not a multiple of 32
    assert not KERNEL.supports(torch.randn(8, 48).bfloat16(), torch.randn(32, 48).bfloat16())
    assert not KERNEL.supports(x, w.t().contiguous().t())  # not a contiguous [N, K] weight
    assert not KERNEL.supports(torch.randn(0, 64).bfloat16(), w)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 32, 33, 64])
def test_the_route_takes_small_bf16_batches(rows):
    fallback = RecordingLinear()
    linear = with_amx_gemm(fallback, 32)
    x, w, b = _operands(rows, 64, 96)
    _close(linear(x, w, b), x, w, b)
    assert fallback.calls == (0 if rows <= 32 else 1)
    linear(x.float(), w.float())  # other dtypes: the platform's
    linear(x, torch.randn(48, 96).bfloat16())  # shapes the kernel does not take: the platform's
    assert fallback.calls == (2 if rows <= 32 else 3)
    assert with_amx_gemm(fallback, 32) is linear  # one function per platform GEMM


def test_no_rows_or_no_kernel_keeps_the_platform_gemm(monkeypatch):
    fallback = RecordingLinear()
    assert with_amx_gemm(fallback, 0) is fallback
    monkeypatch.setattr("qwenserve.layers.native_gemm.bgemm", lambda: None)
    with_amx_gemm.cache_clear()
    try:
        assert with_amx_gemm(fallback, 32) is fallback
    finally:
        with_amx_gemm.cache_clear()


def test_cpu_backends_route_small_bf16_batches_through_it(monkeypatch):
    """The CPU platform's float-linear route sends a decode-sized bf16 batch to this kernel where
    it loads (and to the platform GEMM where it does not), a larger one to the platform GEMM (the
    packed bf16 GEMM of CPUs without AMX, which would take both, off: test_pbgemm.py)."""
    monkeypatch.setattr(CpuPlatform, "packed_bf16_gemm", lambda self: False)
    platform = CpuPlatform()
    assert platform.amx_gemm_max_rows == 96
    base = RecordingLinear()
    route = float_linear_route(platform, base)
    x, w, _ = _operands(64, 64, 96)
    route(x, w)
    assert base.calls == (0 if KERNEL is not None else 1)
    route(torch.randn(97, 96).bfloat16(), w)
    assert base.calls == (1 if KERNEL is not None else 2)
    assert Backends.for_platform(platform).float_linear is float_linear_route(
        platform, platform.float_linear() or F.linear)
