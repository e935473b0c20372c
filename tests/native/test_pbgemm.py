"""The packed bf16 GEMM of AVX512-BF16 CPUs without AMX (native/csrc/pbgemm.cpp): the exact
product rounded once to bf16 (fp32 sums), for any rows of x (the micro-kernel's 6-row blocks and
192-row tasks, and their tails), any N (64-column panels, the last one partial) and any K (an odd
K's last pair padded), with a bias, with x's rows strided; NaN and inf stay in their own rows;
and the CPU platform routes bf16 GEMMs to it only on AVX512-BF16 CPUs without AMX."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.packed_store import settled_packed_bytes
from qwenserve.layers.backends import float_linear_route
from qwenserve.layers.native_gemm import with_packed_bf16_gemm
from qwenserve.native.gemm import Pbgemm, pbgemm
from qwenserve.platforms import cpu as cpu_platform
from qwenserve.platforms.cpu import CpuPlatform

KERNEL = pbgemm()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no AVX512-BF16 in this build")


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _assert_rounded_once(got: torch.Tensor, exact: torch.Tensor) -> None:
    """got is the exact product rounded to bf16, give or take the fp32 sums' error: within one
    bf16 ulp of it (2^-7 relative) plus a little absolute slack for sums that cancel."""
    assert got.dtype == torch.bfloat16
    err = (got.double() - exact).abs()
    bound = exact.abs() * 2.0**-7 + 1e-3 * (exact.abs().max() + 1)
    assert (err <= bound).all(), float((err - bound).max())


@needs_kernel
@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 64, 193, 400])
@pytest.mark.parametrize("n,k", [(64, 64), (65, 37), (1, 2), (130, 1), (200, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_exact_product_rounded_once(m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    got = KERNEL(x, KERNEL.pack(w), n, b)
    assert got.shape == (m, n)
    _assert_rounded_once(got, _exact(x, w, b))


@needs_kernel
def test_a_bf16_bias_is_widened_in_the_kernel_like_a_float32_one():
    """The model's bf16 bias goes in as it is (a replayed decode step has no conversion op
    before the call); widened exactly, it gives the fp32 bias's bits."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(13, 96, generator=gen).bfloat16()
    w = torch.randn(130, 96, generator=gen).bfloat16()
    b = torch.randn(130, generator=gen).bfloat16()
    packed = KERNEL.pack(w)
    assert torch.equal(KERNEL(x, packed, 130, b), KERNEL(x, packed, 130, b.float()))
    assert not torch.equal(KERNEL(x, packed, 130, b), KERNEL(x, packed, 130))


@needs_kernel
def test_reads_strided_rows_and_leading_dimensions():
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(2, 9, 80, generator=gen).bfloat16()
    x = wide[..., 3:67]  # rows 80 apart
    w = torch.randn(70, 64, generator=gen).bfloat16()
    got = KERNEL(x, KERNEL.pack(w), 70)
    assert got.shape == (2, 9, 70)
    _assert_rounded_once(got, _exact(x, w, None))


@needs_kernel
def test_no_rows_give_an_empty_result():
    w = torch.randn(30, 16).bfloat16()
    got = KERNEL(torch.empty(0, 16).bfloat16(), KERNEL.pack(w), 30)
    assert got.shape == (0, 30) and got.dtype == torch.bfloat16


@needs_kernel
def test_nan_and_inf_stay_in_their_rows():
    """A NaN or inf in one row of x reaches that row only; an odd K's padded pair never reads
    past a row (the next row's inf would make 0 * inf = NaN there)."""
    k = 33
    x = torch.ones(8, k).bfloat16()
    x[3, 5] = float("nan")
    x[5, 0] = float("inf")  # the first value after row 4's last
    w = torch.ones(20, k).bfloat16()
    got = KERNEL(x, KERNEL.pack(w), 20)
    assert got[3].isnan().all() and got[5].isinf().all()
    others = [0, 1, 2, 4, 6, 7]
    assert torch.equal(got[others], torch.full((6, 20), float(k)).bfloat16())


@needs_kernel
def test_the_route_packs_once_and_serves_f_linear_calls():
    linear = with_packed_bf16_gemm(F.linear, True)
    packed = linear.args[0]  # (one store for the process: other tests' weights may be in it)
    w = torch.randn(48, 40).bfloat16()
    x = torch.randn(3, 40).bfloat16()
    before = settled_packed_bytes(packed.packed)
    first = linear(x, w)
    assert packed.packed.packed_bytes == before + w.numel() * 2
    torch.testing.assert_close(linear(x, w), first, rtol=0, atol=0)
    assert packed.packed.packed_bytes == before + w.numel() * 2  # packed once
    _assert_rounded_once(first, _exact(x, w, None))
    # float32 and views of a weight go to the route behind it
    wf = torch.randn(48, 40)
    assert torch.equal(linear(x.float(), wf), F.linear(x.float(), wf))
    view = torch.randn(2, 48, 40).bfloat16()[1]
    assert torch.equal(linear(x, view), F.linear(x, view))
    assert with_packed_bf16_gemm(F.linear, False) is F.linear


@pytest.mark.parametrize("flags,switch,native", [
    ({"avx512f", "avx512_bf16"}, None, True),  # AMD Zen 4 / 5
    ({"avx512f", "avx512_bf16"}, "0", False),  # packing turned off
    ({"avx512f", "avx512_bf16", "amx_bf16"}, None, False),  # AMX Xeon: oneDNN's tiles
    ({"avx2"}, None, False)])
def test_platform_takes_the_native_kernel_only_without_amx(monkeypatch, flags, switch, native):
    monkeypatch.setattr(cpu_platform, "_cpu_flags", lambda: frozenset(flags))
    if switch is None:
        monkeypatch.delenv("QWENSERVE_PACKED_BF16", raising=False)
    else:
        monkeypatch.setenv("QWENSERVE_PACKED_BF16", switch)
    platform = CpuPlatform()
    assert platform.packed_bf16_gemm() == native
    route = float_linear_route(platform, F.linear)
    x, w = torch.randn(8, 64).bfloat16(), torch.randn(40, 64).bfloat16()
    calls = []
    real = Pbgemm.__call__
    monkeypatch.setattr(Pbgemm, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    route(x, w)
    assert bool(calls) == (native and KERNEL is not None)
