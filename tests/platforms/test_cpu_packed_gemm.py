"""bf16 GEMMs on weights packed once for oneDNN (AMX / AVX512-BF16 CPUs): the same numbers as
F.linear, packed once per weight, packed again after an in-place write, forgotten with the
weight, and chosen by the CPU platform only where bf16 is native and the switch is on."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from qwenserve.platforms import cpu as cpu_platform
from qwenserve.platforms.cpu import CpuPlatform
from qwenserve.platforms.cpu_packed_gemm import PackedBf16Linear, packed_bf16_linear


@pytest.fixture
def packed() -> PackedBf16Linear:
    if packed_bf16_linear() is None:
        pytest.skip("this torch build / CPU cannot pack bf16 weights for oneDNN")
    return PackedBf16Linear()


@pytest.mark.parametrize("lead", [(1,), (7,), (3, 5), (70,)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(packed, lead, bias):
    x, w = torch.randn(*lead, 96).bfloat16(), torch.randn(40, 96).bfloat16()
    b = torch.randn(40).bfloat16() if bias else None
    got = packed(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (*lead, 40)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1.6e-2, atol=1e-2)


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
    assert len(reorders) == 1 and packed.packed_bytes == w.numel() * 2
    with torch.no_grad():
        w.mul_(-1)  # a weight reloaded in place (same tensor, new values)
    torch.testing.assert_close(packed(x, w), F.linear(x, w), rtol=1.6e-2, atol=1e-2)
    assert len(reorders) == 2 and packed.packed_bytes == w.numel() * 2
    del w
    gc.collect()
    assert packed.packed_bytes == 0 and not packed._packed


def test_other_dtypes_and_layouts_are_not_taken(packed):
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    assert not packed.supports(x, w)
    assert not packed.supports(x.bfloat16(), w.bfloat16().t().contiguous().t())


@pytest.mark.parametrize("native_bf16,switch,expect_packed", [
    (True, None, True), (True, "0", False), (False, None, False)])
def test_platform_routes_bf16_to_packed_weights_only_where_native(monkeypatch, native_bf16,
                                                                  switch, expect_packed):
    if expect_packed and packed_bf16_linear() is None:
        pytest.skip("this torch build / CPU cannot pack bf16 weights for oneDNN")
    monkeypatch.setattr(CpuPlatform, "supports_native_bf16", lambda self: native_bf16)
    if switch is None:
        monkeypatch.delenv("QWENSERVE_PACKED_BF16", raising=False)
    else:
        monkeypatch.setenv("QWENSERVE_PACKED_BF16", switch)
    linear = CpuPlatform().float_linear()
    assert (getattr(linear, "func", None) is cpu_platform._packed_or) == expect_packed
    assert CpuPlatform().float_linear() is linear  # one object per route: wrappers compare it
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(24, 64).bfloat16()
    torch.testing.assert_close((linear or F.linear)(x, w), F.linear(x, w), rtol=1.6e-2,
                               atol=1e-2)
    xf, wf = x.float(), w.float()  # float32 keeps oneDNN's fp32 route either way
    torch.testing.assert_close((linear or F.linear)(xf, wf), F.linear(xf, wf), rtol=1e-5,
                               atol=1e-4)
