"""W8A8's GEMM on AMX-INT8 tiles (native/csrc/igemm.cpp): exact int32 sums scaled as
``int32_epilogue`` scales them, bit for bit, with and without the int32 bias, the per-token
scale and a layer's float bias; partial 16-row blocks of x, several passes, panels split between
threads, strided x; the refusals; and ``Int8Matmul``'s route to it. Skipped where the CPU (or the
process) has no AMX-INT8 tiles: W8A8 then keeps the platform's int8 GEMM."""

from __future__ import annotations

import pytest
import torch

from qwenserve.native.gemm import igemm
from qwenserve.platforms.base import int32_epilogue
from qwenserve.platforms.cpu import CpuPlatform
from qwenserve.quantization.kernels import Int8Matmul

KERNEL = igemm()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no AMX-INT8 tiles here")
# (M, N, K): a partial block; one and two blocks; a pass and a bit; several passes
SHAPES = [(3, 32, 64), (16, 64, 128), (17, 96, 128), (33, 1152, 896), (64, 896, 4864),
          (96, 160, 320), (100, 64, 64)]


@needs_kernel
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_equals_the_torch_epilogue(m, n, k, out_dtype, threads):
    torch.manual_seed(m + n + k)
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) * 1e-3 + 1e-4
    sums = (x.long() @ w.long().t()).int()
    for token_scale in (torch.rand(m, 1) * 0.1 + 0.01, None):
        for int_bias in (torch.randint(-5000, 5000, (n,), dtype=torch.int32), None):
            want = int32_epilogue(sums, scale, token_scale, int_bias, out_dtype)
            got = KERNEL.scaled(x, w, scale, token_scale, int_bias, out_dtype)
            assert got.dtype == out_dtype and torch.equal(got, want)
    bias = torch.randn(n).to(out_dtype)
    got = KERNEL.scaled(x, w, scale, None, None, out_dtype, bias)
    assert torch.equal(got, int32_epilogue(sums, scale, None, None, out_dtype) + bias)


@needs_kernel
def test_strided_rows_of_x_are_read_in_place():
    torch.manual_seed(0)
    wide = torch.randint(-128, 128, (20, 192), dtype=torch.int8)
    x, w = wide[:, :128], torch.randint(-128, 128, (64, 128), dtype=torch.int8)
    scale = torch.rand(64)
    want = int32_epilogue((x.long() @ w.long().t()).int(), scale, None, None, torch.float32)
    assert torch.equal(KERNEL.scaled(x, w, scale, None, None, torch.float32), want)


@needs_kernel
def test_what_it_does_not_take_is_left_to_the_caller():
    x = torch.zeros(4, 64, dtype=torch.int8)
    assert KERNEL.scaled(x, torch.zeros(48, 64, dtype=torch.int8), torch.ones(48), None, None,
                         torch.float32) is None  # N not a multiple of 32
    assert KERNEL.scaled(torch.zeros(4, 96, dtype=torch.int8),
                         torch.zeros(32, 96, dtype=torch.int8), torch.ones(32), None, None,
                         torch.float32) is None  # K not a multiple of 64
    assert KERNEL.scaled(x, torch.zeros(32, 64, dtype=torch.int8), torch.ones(32), None, None,
                         torch.float16) is None


@needs_kernel
def test_int8_matmul_routes_its_window_to_the_kernel(monkeypatch):
    """Above the skinny rows and up to the platform's window: the kernel (the platform's int8
    GEMM is not called); past the window: the platform's."""
    platform = CpuPlatform()
    calls = []
    real = platform.int8_scaled_mm
    monkeypatch.setattr(platform, "int8_scaled_mm", lambda *a: calls.append(1) or real(*a))
    matmul = Int8Matmul(platform)
    w = torch.randint(-128, 128, (64, 128), dtype=torch.int8)
    scale, token = torch.rand(64), None
    for rows, platform_calls in ((8, 0), (platform.amx_int8_max_rows + 1, 1)):
        x = torch.randint(-128, 128, (rows, 128), dtype=torch.int8)
        got = matmul(x, w, scale, token, None, torch.float32)
        want = int32_epilogue((x.long() @ w.long().t()).int(), scale, None, None,
                              torch.float32)
        torch.testing.assert_close(got, want)
        assert len(calls) == platform_calls
