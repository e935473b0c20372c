"""GEMMs on weights packed once for oneDNN: bf16 (AMX / AVX512-BF16 CPUs) and float32 (AVX512
CPUs) give F.linear's numbers and int8 (AMX / VNNI) the exact W8A8 sums; each weight is packed once, packed again after
an in-place write, forgotten with the weight; views are left to the plain kernels; and the CPU
platform chooses them only where the CPU runs them natively and the switch is on."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.nn.functional as F

from qwenserve.platforms import cpu as cpu_platform
from qwenserve.platforms.base import int32_epilogue
from qwenserve.platforms.cpu import CpuPlatform
from qwenserve.platforms.cpu_packed_gemm import (
    PackedFloatLinear,
    PackedInt8Matmul,
    much_slower,
    packed_float_linear,
    packed_int8_matmul,
)


def _packed_or_skip(dtype: torch.dtype) -> PackedFloatLinear:
    if packed_float_linear(dtype) is None:
        pytest.skip(f"this torch build / CPU cannot pack {dtype} weights for oneDNN")
    return PackedFloatLinear(dtype)


@pytest.fixture
def packed() -> PackedFloatLinear:
    return _packed_or_skip(torch.bfloat16)


# tolerances for one product of K <= 96 against F.linear's: bf16's rounding, float32's sums
_TOLERANCE = {torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
              torch.float32: {"rtol": 1e-5, "atol": 1e-4}}


@pytest.fixture
def packed_int8() -> PackedInt8Matmul:
    if packed_int8_matmul() is None:
        pytest.skip("this torch build / CPU cannot pack int8 weights for oneDNN")
    return PackedInt8Matmul()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lead", [(1,), (7,), (3, 5), (70,)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(dtype, lead, bias):
    packed = _packed_or_skip(dtype)
    x, w = torch.randn(*lead, 96).to(dtype), torch.randn(40, 96).to(dtype)
    b = torch.randn(40).to(dtype) if bias else None
    got = packed(x, w, b)
    assert got.dtype == dtype and got.shape == (*lead, 40)
    torch.testing.assert_close(got, F.linear(x, w, b), **_TOLERANCE[dtype])


def test_packs_once_repacks_after_a_write_and_forgets_freed_weights(packed, monkeypatch):
    reorders = []
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def counting(w, hint):
        reorders.append(w.shape)
        return reorder(w, hint)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", counting)
    x = torch.randn(4, 32).bfloat16()
    w = torch.nn.Parameter(torch.randn(16, 32).bfloat16(), requires_grad=False)
    for _ in range(3):
        packed(x, w)
    assert len(reorders) == 1 and packed.packed.packed_bytes == w.numel() * 2
    with torch.no_grad():
        w.mul_(-1)  # a weight reloaded in place (same tensor, new values)
    torch.testing.assert_close(packed(x, w), F.linear(x, w), rtol=1.6e-2, atol=1e-2)
    assert len(reorders) == 2 and packed.packed.packed_bytes == w.numel() * 2
    del w
    gc.collect()
    assert packed.packed.packed_bytes == 0 and not packed.packed._packed


def test_other_dtypes_layouts_and_views_are_not_taken(packed):
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    assert not packed.supports(x, w)  # the bf16 kernel takes no float32 weight
    assert not packed.supports(x.bfloat16(), w)  # nor a mixed pair
    assert not packed.supports(x.bfloat16(), w.bfloat16().t().contiguous().t())
    stacked = torch.randn(3, 16, 32).bfloat16()  # experts: stacked[e] is a new view per call
    assert not packed.supports(x.bfloat16(), stacked[1])


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("bias,out_dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_int8_sums_exactly_as_the_int32_epilogue(packed_int8, rows, bias, out_dtype):
    a_q = torch.randint(-128, 128, (rows, 100), dtype=torch.int8)  # K not a multiple of 4 or 64
    w_q = torch.randint(-127, 128, (72, 100), dtype=torch.int8)
    scale, token_scale = torch.rand(72) * 1e-2, torch.rand(rows, 1)
    int_bias = torch.randint(-5000, 5000, (72,), dtype=torch.int32) if bias else None
    want = int32_epilogue(a_q.int() @ w_q.int().t(), scale, token_scale, int_bias, out_dtype)
    got = packed_int8(a_q, w_q, scale, token_scale, int_bias, out_dtype)
    assert got.dtype == out_dtype and got.shape == (rows, 72)
    torch.testing.assert_close(got, want, rtol=1e-6 if out_dtype == torch.float32 else 8e-3,
                               atol=1e-6)


def test_int8_packs_once_and_repacks_after_a_write(packed_int8):
    a_q = torch.randint(-128, 128, (2, 64), dtype=torch.int8)
    w_q = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    scale = torch.ones(8)
    packed_int8(a_q, w_q, scale, None, None, torch.float32)
    first = packed_int8.packed(w_q)
    assert packed_int8.packed(w_q) is first and packed_int8.packed.packed_bytes == w_q.numel()
    w_q.neg_()
    assert packed_int8.packed(w_q) is not first
    torch.testing.assert_close(packed_int8(a_q, w_q, scale, None, None, torch.float32),
                               (a_q.int() @ w_q.int().t()).float())
    assert not packed_int8.supports(a_q, torch.stack([w_q, w_q])[0])
    assert not packed_int8.supports(a_q.float(), w_q)


def set_switch(monkeypatch, name: str, value: str | None) -> None:
    """The environment switch ``name`` set to ``value``, or unset (None)."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("int8_dot,switch,expect_packed", [
    (True, None, True), (True, "0", False), (False, None, False)])
def test_platform_routes_int8_to_packed_weights_only_with_vnni_or_amx(monkeypatch, int8_dot,
                                                                      switch, expect_packed):
    if expect_packed and packed_int8_matmul() is None:
        pytest.skip("this torch build / CPU cannot pack int8 weights for oneDNN")
    monkeypatch.setattr(CpuPlatform, "_has_int8_dot", staticmethod(lambda: int8_dot))
    monkeypatch.setattr(cpu_platform, "int8_packing_pays", lambda: True)  # (speed: below)
    set_switch(monkeypatch, "QWENSERVE_PACKED_INT8", switch)
    calls = []
    monkeypatch.setattr(PackedInt8Matmul, "__call__",
                        lambda self, *args: calls.append(args) or torch.zeros(1))
    a_q = torch.randint(-128, 128, (3, 32), dtype=torch.int8)
    w_q = torch.randint(-127, 128, (8, 32), dtype=torch.int8)
    CpuPlatform().int8_scaled_mm(a_q, w_q, torch.ones(8), None, None, torch.float32)
    assert bool(calls) == expect_packed


def test_int8_packing_is_left_where_onednn_runs_it_on_a_reference_path(monkeypatch):
    """On a Zen 5 EPYC (AVX512-VNNI, no AMX) oneDNN's packed int8 GEMM ran at 0.2 GOP/s, ~1,000x
    below torch._int_mm: the platform then keeps torch._int_mm (the probe compares the two)."""
    assert much_slower(lambda: time.sleep(0.01), lambda: None)
    assert not much_slower(lambda: None, lambda: time.sleep(0.01))
    monkeypatch.setattr(CpuPlatform, "_has_int8_dot", staticmethod(lambda: True))
    monkeypatch.delenv("QWENSERVE_PACKED_INT8", raising=False)
    monkeypatch.setattr(cpu_platform, "int8_packing_pays", lambda: False)
    assert CpuPlatform()._packed_int8 is None
    a_q = torch.randint(-128, 128, (3, 32), dtype=torch.int8)
    w_q = torch.randint(-127, 128, (8, 32), dtype=torch.int8)
    got = CpuPlatform().int8_scaled_mm(a_q, w_q, torch.ones(8), None, None, torch.float32)
    torch.testing.assert_close(got, (a_q.float() @ w_q.float().t()))


# (dtype, the CPU feature it needs, its switch): bf16 where bf16 is native, float32 on AVX512
_FLOAT_ROUTES = {torch.bfloat16: ("supports_native_bf16", "QWENSERVE_PACKED_BF16"),
                 torch.float32: ("_has_avx512", "QWENSERVE_PACKED_FP32")}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("feature,switch,expect_packed", [
    (True, None, True), (True, "0", False), (False, None, False)])
def test_platform_routes_floats_to_packed_weights_only_where_the_cpu_runs_them(
        monkeypatch, dtype, feature, switch, expect_packed):
    if expect_packed and packed_float_linear(dtype) is None:
        pytest.skip(f"this torch build / CPU cannot pack {dtype} weights for oneDNN")
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    for kind, (probe, env) in _FLOAT_ROUTES.items():  # the other dtype's route off
        on = feature if kind == dtype else False
        monkeypatch.setattr(CpuPlatform, probe, staticmethod(lambda *_, on=on: on))
        set_switch(monkeypatch, env, switch if kind == dtype else None)
    packed_calls = []
    real_call = PackedFloatLinear.__call__
    monkeypatch.setattr(PackedFloatLinear, "__call__", lambda self, *args: (
        packed_calls.append(self.dtype) or real_call(self, *args)))
    linear = CpuPlatform().float_linear()
    assert (getattr(linear, "func", None) is cpu_platform._packed_or) == expect_packed
    assert CpuPlatform().float_linear() is linear  # one object per route: wrappers compare it
    for t in (dtype, other):
        x, w = torch.randn(6, 64).to(t), torch.randn(24, 64).to(t)
        torch.testing.assert_close((linear or F.linear)(x, w), F.linear(x, w), **_TOLERANCE[t])
    assert packed_calls == ([dtype] if expect_packed else [])
