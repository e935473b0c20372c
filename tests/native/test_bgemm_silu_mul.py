"""An MLP's gate_up GEMM with its SiLU-and-mul in the AMX kernel's epilogue
(``Bgemm.silu_mul``, native/csrc/bgemm.cpp) against the unfused path the MLP otherwise runs (the
same kernel's GEMM, then elementwise.cpp's SiLU-and-mul): equal bit for bit, at one and two
16-row blocks of x a pass, several passes, partial blocks, I a multiple of 16 but not 32, bias,
strided x, one and two threads; and the seam: which MLP calls take it (bf16, unquantized, the
AMX GEMM's rows) and that the model's output is the unfused one's."""

from __future__ import annotations

import pytest
import torch

from helpers.fused_mlp import fused_calls_match_unfused, small_mlp
from qwenserve.layers.activation import silu_and_mul
from qwenserve.layers.backends import Backends
from qwenserve.layers.native_gemm import amx_gate_up_silu
from qwenserve.native.elementwise import elementwise
from qwenserve.native.gemm import bgemm
from qwenserve.platforms.cpu import CpuPlatform

KERNEL, ELEMENTWISE = bgemm(), elementwise()
pytestmark = pytest.mark.skipif(KERNEL is None or ELEMENTWISE is None,
                                reason="no AMX tiles (or no compiler) here")
# (M, I, K): one row; a partial block; a pass and a bit; I of 16 (one task); 64 rows at the
# Qwen2.5-0.5B shape; the route's last row count; past it
SHAPES = [(1, 16, 32), (7, 48, 64), (33, 144, 128), (17, 16, 96), (64, 4864, 896),
          (96, 1120, 896), (100, 32, 320)]


def _unfused(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return ELEMENTWISE.silu_and_mul(KERNEL(x, w, b))


@pytest.mark.parametrize("m,inter,k", SHAPES)
def test_equals_the_gemm_then_silu_and_mul(m, inter, k, threads):
    gen = torch.Generator().manual_seed(m * inter + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(2 * inter, k, generator=gen) * 3 / k ** 0.5).bfloat16()
    b = torch.randn(2 * inter, generator=gen).bfloat16()
    assert KERNEL.supports(x, w)
    for bias in (None, b):
        got = KERNEL.silu_mul(x, w, bias)
        assert got.shape == (m, inter) and got.dtype == torch.bfloat16
        assert torch.equal(got, _unfused(x, w, bias))
    # and close to the reference in fp32 (a check on the unfused path too)
    ref = silu_and_mul(torch.nn.functional.linear(x.float(), w.float()))
    torch.testing.assert_close(KERNEL.silu_mul(x, w).float(), ref, rtol=2 ** -6, atol=1e-2)


def test_strided_and_batched_x():
    w = torch.randn(96, 256).bfloat16()
    view = torch.randn(40, 300).bfloat16()[3:, 10:266]
    assert torch.equal(KERNEL.silu_mul(view, w), _unfused(view, w, None))
    x3 = torch.randn(2, 9, 256).bfloat16()
    got = KERNEL.silu_mul(x3, w)
    assert got.shape == (2, 9, 48)
    assert torch.equal(got.view(18, 48), _unfused(x3.view(18, 256), w, None))


def test_the_route_takes_the_amx_gemm_rows_only():
    fused = amx_gate_up_silu(2, 96)
    w = torch.randn(64, 96).bfloat16()
    for rows, taken in ((1, False), (2, True), (96, True), (97, False)):
        got = fused(torch.randn(rows, 96).bfloat16(), w, None)
        assert (got is not None) == taken, rows
    assert fused(torch.randn(8, 96), w.float(), None) is None  # float32: the unfused path
    assert fused(torch.randn(8, 96).bfloat16(), torch.randn(48, 96).bfloat16(), None) is None
    assert amx_gate_up_silu(2, 0) is None
    assert Backends.for_platform(CpuPlatform()).gate_up_silu is amx_gate_up_silu(2, 96)


@pytest.mark.parametrize("bias", [False, True])
def test_the_mlp_output_is_the_unfused_one(bias):
    """A CPU MLP at decode rows takes the fused kernel and gives the unfused path's output (the
    same module with the seam off); 200 rows (past the AMX GEMM's) are left to the unfused
    path."""
    backends = Backends.for_platform(CpuPlatform())
    mlp = small_mlp(backends, bias, 80)
    assert mlp.gate_up_silu is backends.gate_up_silu is not None
    assert fused_calls_match_unfused(mlp, (3, 64, 200)) == [True, True, False]
