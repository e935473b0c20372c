"""W8A8's packed int8 GEMM of AVX512-VNNI CPUs without AMX (native/csrc/pigemm.cpp): exact int32
sums (x entering vpdpbusd as x + 128, the pack's per-column correction taking that back out)
scaled as ``int32_epilogue`` scales them, bit for bit, with and without the int32 bias, the
per-token scale and a layer's float bias; any rows of x (6-row blocks, 192-row tasks, their
tails), any N (64-column panels, the last one partial), any K (a last partial quad); extreme
values; strided x; the bf16 rounding of builds without AVX512-BF16; the MLP's gate_up GEMM with
SiLU-and-mul in its epilogue (the unfused bits); the refusals; the packed weights' store; and
the routes: ``Int8Matmul`` at every row count (views to the skinny GEMV), the platform only on
VNNI CPUs without AMX-INT8."""

from __future__ import annotations

import os

import pytest
import torch

from qwenserve.native.build import CSRC, DEFAULT_CFLAGS, load_library
from qwenserve.native.elementwise import elementwise
from qwenserve.native.gemm import Pigemm, pigemm
from qwenserve.platforms import cpu as cpu_platform
from qwenserve.platforms.base import int32_epilogue
from qwenserve.platforms.cpu import CpuPlatform
from qwenserve.platforms.cpu_packed_gemm import PackedScaledInt8
from qwenserve.quantization.kernels import Int8Matmul

KERNEL = pigemm()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no AVX512-VNNI in this build")
# (M, N, K): single rows and partial 6-row blocks, partial panels, K with a last partial quad,
# the model's shapes at decode and prefill sizes, more rows than a task takes
SHAPES = [(1, 64, 64), (3, 32, 64), (7, 65, 37), (13, 130, 5), (64, 1152, 896),
          (64, 896, 4864), (193, 200, 96), (400, 64, 3)]


def _sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.long() @ w.long().t()).int()


def _check_epilogues(kernel: Pigemm, m: int, n: int, k: int, out_dtype: torch.dtype) -> None:
    torch.manual_seed(m + n + k)
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) * 1e-3 + 1e-4
    packed, sums = kernel.pack(w), _sums(x, w)
    for token_scale in (torch.rand(m, 1) * 0.1 + 0.01, None):
        for int_bias in (torch.randint(-5000, 5000, (n,), dtype=torch.int32), None):
            want = int32_epilogue(sums, scale, token_scale, int_bias, out_dtype)
            got = kernel.scaled(x, packed, n, scale, token_scale, int_bias, out_dtype)
            assert got.dtype == out_dtype and torch.equal(got, want), (token_scale, int_bias)
    bias = torch.randn(n).to(out_dtype)
    got = kernel.scaled(x, packed, n, scale, None, None, out_dtype, bias)
    assert torch.equal(got, int32_epilogue(sums, scale, None, None, out_dtype) + bias)


@needs_kernel
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_equals_the_torch_epilogue(m, n, k, out_dtype, threads):
    _check_epilogues(KERNEL, m, n, k, out_dtype)


@needs_kernel
def test_extreme_values_sum_exactly():
    """x and w at -128 and 127 over a long K: x + 128 reaches 255 and 0, each column's
    correction 128 * 127 * K; the int32 sums stay exact (scale 1: any lost unit would show)."""
    k = 4864
    x = torch.tensor([[-128] * k, [127] * k, [-128, 127] * (k // 2)], dtype=torch.int8)
    w = torch.tensor([[-128] * k, [127] * k, [127, -128] * (k // 2)] * 22, dtype=torch.int8)
    got = KERNEL.scaled(x, KERNEL.pack(w), w.shape[0], torch.ones(w.shape[0]), None, None,
                        torch.float32)
    assert torch.equal(got, _sums(x, w).float())


@needs_kernel
def test_strided_rows_of_x_are_read_in_place():
    torch.manual_seed(0)
    wide = torch.randint(-128, 128, (20, 192), dtype=torch.int8)
    x, w = wide[:, 3:131], torch.randint(-128, 128, (70, 128), dtype=torch.int8)
    scale = torch.rand(70)
    want = int32_epilogue(_sums(x, w), scale, None, None, torch.float32)
    assert torch.equal(KERNEL.scaled(x, KERNEL.pack(w), 70, scale, None, None, torch.float32),
                       want)


@needs_kernel
def test_rows_that_share_memory_are_read_as_rows():
    """An expanded row (row stride 0) is M equal rows, not M rows read past the first."""
    torch.manual_seed(2)
    row = torch.randint(-128, 128, (1, 96), dtype=torch.int8)
    x, w = row.expand(5, 96), torch.randint(-128, 128, (64, 96), dtype=torch.int8)
    scale = torch.rand(64)
    want = int32_epilogue(_sums(x.contiguous(), w), scale, None, None, torch.float32)
    assert torch.equal(KERNEL.scaled(x, KERNEL.pack(w), 64, scale, None, None, torch.float32),
                       want)


@needs_kernel
def test_a_build_without_avx512_bf16_rounds_bf16_as_torch():
    """VNNI CPUs before Zen 4 / Cooper Lake round the bf16 output with integer steps instead of
    vcvtneps2bf16: the same bits (built here with AVX512-BF16 switched off)."""
    flags = (*DEFAULT_CFLAGS, "-ffp-contract=off", "-mno-avx512bf16")
    lib = load_library("qwenserve_pigemm_nobf16", [os.path.join(CSRC, "pigemm.cpp")], flags)
    assert lib is not None and lib.pigemm_available()
    for m, n, k in ((7, 65, 37), (64, 1152, 896)):
        _check_epilogues(Pigemm(lib), m, n, k, torch.bfloat16)


@needs_kernel
def test_what_it_does_not_take_is_left_to_the_caller():
    w = torch.zeros(64, 64, dtype=torch.int8)
    packed, scale = KERNEL.pack(w), torch.ones(64)
    x = torch.zeros(4, 64, dtype=torch.int8)
    assert KERNEL.scaled(x, packed, 64, scale, None, None, torch.float16) is None
    assert KERNEL.scaled(x.float(), packed, 64, scale, None, None, torch.float32) is None
    assert KERNEL.scaled(x, packed[:-1], 64, scale, None, None, torch.float32) is None
    assert KERNEL.scaled(x, packed, 64, scale.double(), None, None, torch.float32) is None
    assert KERNEL.scaled(x.t(), packed, 64, scale, None, None, torch.float32) is None
    long_k = torch.zeros(1, 1 << 16, dtype=torch.int8)  # sums could leave int32
    assert KERNEL.scaled(long_k, KERNEL.pack(torch.zeros(1, 1 << 16, dtype=torch.int8)), 1,
                         torch.ones(1), None, None, torch.float32) is None


@needs_kernel
def test_the_store_packs_once_leaves_views_and_repacks_a_written_weight():
    store = PackedScaledInt8(KERNEL)
    w = torch.randint(-128, 128, (96, 64), dtype=torch.int8)
    x = torch.randint(-128, 128, (5, 64), dtype=torch.int8)
    scale = torch.rand(96)
    first = store.scaled(x, w, scale, None, None, torch.float32)
    assert store.packed.packed_bytes == w.numel()
    assert torch.equal(store.scaled(x, w, scale, None, None, torch.float32), first)
    assert store.packed.packed_bytes == w.numel()  # packed once
    assert torch.equal(first, int32_epilogue(_sums(x, w), scale, None, None, torch.float32))
    stacked = torch.randint(-128, 128, (2, 96, 64), dtype=torch.int8)
    assert store.scaled(x, stacked[1], scale, None, None, torch.float32) is None  # a view
    w.neg_()  # written in place: packed again
    assert torch.equal(store.scaled(x, w, scale, None, None, torch.float32),
                       int32_epilogue(_sums(x, w), scale, None, None, torch.float32))


@needs_kernel
def test_int8_matmul_sends_every_row_count_to_the_kernel_and_views_to_the_gemv(monkeypatch):
    """With the platform's packed int8 GEMM on: any rows the packed kernel with its scaling and
    the layer's bias (the platform's int8 GEMM is not called); a weight it does not pack (one
    MoE expert's view) at 1-2 rows the skinny GEMV, as before."""
    monkeypatch.setattr(CpuPlatform, "packed_int8_gemm", lambda self: True)
    monkeypatch.setattr(CpuPlatform, "amx_int8_max_rows", 0)
    platform = CpuPlatform()
    monkeypatch.setattr(platform, "int8_scaled_mm", lambda *a: pytest.fail("platform GEMM"))
    kernel_rows = []
    real = Pigemm.scaled
    monkeypatch.setattr(Pigemm, "scaled", lambda self, a, *rest: kernel_rows.append(a.shape[0])
                        or real(self, a, *rest))
    matmul = Int8Matmul(platform)
    w = torch.randint(-128, 128, (64, 128), dtype=torch.int8)
    scale, bias = torch.rand(64), torch.randn(64).bfloat16()
    for rows in (1, 3, 64, 300):
        x = torch.randint(-128, 128, (rows, 128), dtype=torch.int8)
        token = torch.rand(rows, 1)
        got = matmul(x, w, scale, token, None, torch.bfloat16, bias)
        want = int32_epilogue(_sums(x, w), scale, token, None, torch.bfloat16) + bias
        assert torch.equal(got, want), rows
    assert kernel_rows == [1, 3, 64, 300]
    experts = torch.randint(-128, 128, (2, 64, 128), dtype=torch.int8)
    x = torch.randint(-128, 128, (1, 128), dtype=torch.int8)
    got = matmul(x, experts[1], scale, None, None, torch.float32)
    assert torch.equal(got, int32_epilogue(_sums(x, experts[1]), scale, None, None,
                                           torch.float32))
    assert kernel_rows == [1, 3, 64, 300]  # the view went to the GEMV


@needs_kernel
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "inter", "k"), [(1, 64, 64), (7, 128, 37), (64, 4864, 896),
                                                (200, 192, 100)])
def test_silu_mul_is_the_gemm_then_silu_and_mul_bit_for_bit(m, inter, k, out_dtype, threads):
    """The MLP's gate_up GEMM with SiLU-and-mul in the epilogue: elementwise's SiLU-and-mul of
    the scaled GEMM's output exactly (with either bf16 SiLU route), and the down input it
    quantizes to is the fused W8A8 middle's (silu_mul_quantize on the float32 sums)."""
    quantizer = elementwise()
    if quantizer is None:
        pytest.skip("no native elementwise kernels")
    torch.manual_seed(m + inter + k)
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-128, 128, (2 * inter, k), dtype=torch.int8)
    scale, token = torch.rand(2 * inter) * 1e-3 + 1e-5, torch.rand(m, 1) * 0.1 + 0.01
    packed = KERNEL.pack(w)
    routes = (False, True) if out_dtype == torch.bfloat16 else (None,)
    for table in routes:
        previous = quantizer.use_silu_table(table) if table is not None else None
        try:
            fused = KERNEL.silu_mul(x, packed, 2 * inter, scale, token, out_dtype)
            gemm = KERNEL.scaled(x, packed, 2 * inter, scale, token, None, out_dtype)
            assert fused.dtype == out_dtype and torch.equal(fused, quantizer.silu_and_mul(gemm))
            sums = KERNEL.scaled(x, packed, 2 * inter, scale, None, None, torch.float32)
            want_q, want_scale = quantizer.silu_mul_quantize(sums, token, out_dtype)
            got_q, got_scale = quantizer.quantize_per_token(fused)
            assert torch.equal(got_q, want_q) and torch.equal(got_scale, want_scale)
        finally:
            if previous is not None:
                quantizer.use_silu_table(previous)


@needs_kernel
def test_silu_mul_leaves_what_it_does_not_take():
    x, w = torch.zeros(3, 64, dtype=torch.int8), torch.zeros(2 * 96, 64, dtype=torch.int8)
    assert KERNEL.silu_mul(x, KERNEL.pack(w), 2 * 96, torch.ones(192), torch.ones(3, 1),
                           torch.float32) is None  # I = 96: a panel would hold gate and up
    w = torch.zeros(128, 64, dtype=torch.int8)
    assert KERNEL.silu_mul(x, KERNEL.pack(w), 128, torch.ones(128), torch.ones(3, 1),
                           torch.float16) is None


@pytest.mark.parametrize("flags,switch,native", [
    ({"avx512f", "avx512_vnni"}, None, True),  # AMD Zen 4 / 5, Ice Lake / Cascade Lake
    ({"avx512f", "avx512_vnni"}, "0", False),  # packing turned off
    ({"avx512f", "avx512_vnni", "amx_int8"}, None, False),  # AMX Xeon: its tile kernel
    ({"avx2", "avx_vnni"}, None, False)])  # no 512-bit VNNI
def test_platform_takes_the_packed_kernel_only_on_vnni_without_amx(monkeypatch, flags, switch,
                                                                  native):
    monkeypatch.setattr(cpu_platform, "_cpu_flags", lambda: frozenset(flags))
    if switch is None:
        monkeypatch.delenv("QWENSERVE_PACKED_INT8", raising=False)
    else:
        monkeypatch.setenv("QWENSERVE_PACKED_INT8", switch)
    assert CpuPlatform().packed_int8_gemm() == native
    assert (Int8Matmul(CpuPlatform()).packed is not None) == (native and KERNEL is not None)
