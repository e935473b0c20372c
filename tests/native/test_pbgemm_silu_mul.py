"""An MLP's gate_up GEMM with its SiLU-and-mul in the packed bf16 GEMM's epilogue
(``Pbgemm.silu_mul``, native/csrc/pbgemm.cpp, AVX512-BF16 CPUs without AMX) against the unfused
path (the same kernel's GEMM, then elementwise.cpp's SiLU-and-mul): equal bit for bit at partial
and whole 6-row blocks, several 192-row tasks, one panel of I and many, odd K, a bf16 or fp32
bias, strided and batched x, one and two threads; both SiLU routes of the unfused path (table and
computed) give those bits; I not a multiple of 64 is refused; and the seam: which MLP calls
take it (bf16, unquantized, two rows or more), on the packed copy the GEMM route keeps, and that
the model's output is the unfused one's."""

from __future__ import annotations

import pytest
import torch

from helpers.fused_mlp import fused_calls_match_unfused, small_mlp
from helpers.packed_store import settled_packed_bytes
from qwenserve.layers.activation import silu_and_mul
from qwenserve.layers.backends import Backends
from qwenserve.layers.native_gemm import packed_bf16_kernel, packed_gate_up_silu
from qwenserve.native.elementwise import elementwise
from qwenserve.native.gemm import pbgemm
from qwenserve.platforms import cpu as cpu_platform
from qwenserve.platforms.cpu import CpuPlatform

KERNEL, ELEMENTWISE = pbgemm(), elementwise()
pytestmark = pytest.mark.skipif(KERNEL is None or ELEMENTWISE is None,
                                reason="no AVX512-BF16 (or no compiler) here")
# (M, I, K): one row; partial and whole 6-row blocks; more than a 192-row task; the Qwen2.5-0.5B
# MLP at decode rows; an odd K
SHAPES = [(1, 64, 32), (5, 64, 64), (12, 128, 96), (200, 192, 64), (64, 4864, 896),
          (13, 64, 37)]


def _unfused(x: torch.Tensor, packed: torch.Tensor, n: int,
             b: torch.Tensor | None) -> torch.Tensor:
    return ELEMENTWISE.silu_and_mul(KERNEL(x, packed, n, b))


@pytest.mark.parametrize("m,inter,k", SHAPES)
def test_equals_the_gemm_then_silu_and_mul(m, inter, k, threads):
    gen = torch.Generator().manual_seed(m * inter + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(2 * inter, k, generator=gen) * 3 / k ** 0.5).bfloat16()
    b = torch.randn(2 * inter, generator=gen).bfloat16()
    packed = KERNEL.pack(w)
    for bias in (None, b, b.float()):
        got = KERNEL.silu_mul(x, packed, 2 * inter, bias)
        assert got.shape == (m, inter) and got.dtype == torch.bfloat16
        assert torch.equal(got, _unfused(x, packed, 2 * inter, bias))
    # and close to the reference in fp32 (a check on the unfused path too)
    ref = silu_and_mul(torch.nn.functional.linear(x.float(), w.float()))
    torch.testing.assert_close(KERNEL.silu_mul(x, packed, 2 * inter).float(), ref,
                               rtol=2 ** -6, atol=1e-2)


def test_both_silu_routes_of_the_unfused_path_give_its_bits():
    """The fused epilogue computes SiLU or looks it up as its CPU's default says; the unfused
    path's table and computed routes are the same bits, so either equals it."""
    x = torch.randn(30, 128).bfloat16() * 4
    w = torch.randn(256, 128).bfloat16() / 4
    packed = KERNEL.pack(w)
    got = KERNEL.silu_mul(x, packed, 256)
    previous = ELEMENTWISE.use_silu_table(True)
    try:
        for table in (True, False):
            ELEMENTWISE.use_silu_table(table)
            assert torch.equal(got, _unfused(x, packed, 256, None)), table
    finally:
        ELEMENTWISE.use_silu_table(previous)


def test_strided_and_batched_x():
    w = torch.randn(128, 256).bfloat16()
    packed = KERNEL.pack(w)
    view = torch.randn(40, 300).bfloat16()[3:, 10:266]
    assert torch.equal(KERNEL.silu_mul(view, packed, 128), _unfused(view, packed, 128, None))
    x3 = torch.randn(2, 9, 256).bfloat16()
    got = KERNEL.silu_mul(x3, packed, 128)
    assert got.shape == (2, 9, 64)
    assert torch.equal(got.view(18, 64), _unfused(x3.view(18, 256), packed, 128, None))


def test_an_intermediate_size_off_the_panels_is_refused():
    """I = 80: gate's second panel would hold up's first columns; the kernel refuses the call
    and the route leaves it to the unfused path."""
    w = torch.randn(160, 64).bfloat16()
    assert not KERNEL.silu_mul_takes(160)
    with pytest.raises(AssertionError, match="multiple of 64"):
        KERNEL.silu_mul(torch.randn(4, 64).bfloat16(), KERNEL.pack(w), 160)
    assert packed_gate_up_silu(2, True)(torch.randn(4, 64).bfloat16(), w, None) is None


def test_the_route_takes_bf16_calls_of_two_rows_or_more_on_the_shared_packing():
    fused = packed_gate_up_silu(2, True)
    w = torch.randn(128, 96).bfloat16()
    store = packed_bf16_kernel()[1].packed
    before = settled_packed_bytes(store)
    for rows, taken in ((1, False), (2, True), (300, True)):
        got = fused(torch.randn(rows, 96).bfloat16(), w, None)
        assert (got is not None) == taken, rows
    assert store.packed_bytes == before + w.numel() * 2  # packed once, in the GEMM's store
    assert fused(torch.randn(8, 96), w.float(), None) is None  # float32: the unfused path
    assert packed_gate_up_silu(2, False) is None


@pytest.mark.parametrize("amx", [False, True])
def test_the_platform_fuses_on_the_packed_gemm_only_without_amx(monkeypatch, amx):
    flags = {"avx512f", "avx512_bf16"} | ({"amx_bf16"} if amx else set())
    monkeypatch.setattr(cpu_platform, "_cpu_flags", lambda: flags)
    fused = Backends.for_platform(CpuPlatform()).gate_up_silu
    if amx:
        assert fused is not packed_gate_up_silu(2, True)
    else:
        assert fused is packed_gate_up_silu(2, True)


@pytest.mark.parametrize("bias", [False, True])
def test_the_mlp_output_is_the_unfused_one(monkeypatch, bias):
    """A CPU MLP (without AMX) at decode and prefill rows takes the fused kernel and gives the
    unfused path's output (the same module with the seam off); one row is left to the skinny
    GEMM's unfused path; 700 rows are two chunks of the MLP's 512."""
    monkeypatch.setattr(cpu_platform, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    backends = Backends.for_platform(CpuPlatform())
    mlp = small_mlp(backends, bias, 128)
    assert mlp.gate_up_silu is backends.gate_up_silu is packed_gate_up_silu(2, True)
    assert fused_calls_match_unfused(mlp, (1, 3, 64, 700)) == [False, True, True, True, True]
