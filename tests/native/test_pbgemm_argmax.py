"""A greedy LM head in the packed bf16 GEMM (``Pbgemm.argmax``, native/csrc/pbgemm.cpp,
AVX512-BF16 CPUs without AMX): each row's argmax over the logits the same kernel's GEMM gives,
against that GEMM followed by ``torch.argmax``: equal at partial and whole 6-row blocks, more
than a 192-row task, a partial last panel, one panel (fewer panels than threads), ties (the
first column wins, in one lane, across lanes, panels and threads), -inf and NaN logits, a bf16
or fp32 bias, strided and batched x, one and two threads; and the seam: which calls the route
takes, on the GEMM route's packed copy, and the LM head's ``greedy_tokens``."""

from __future__ import annotations

import pytest
import torch

from helpers.greedy_head import check_infinite_and_nan_logits, check_lm_head_takes_it
from qwenserve.layers.backends import Backends
from qwenserve.layers.native_gemm import packed_greedy_head
from qwenserve.native.gemm import pbgemm
from qwenserve.platforms import cpu as cpu_platform
from qwenserve.platforms.cpu import CpuPlatform

KERNEL = pbgemm()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no AVX512-BF16 (or no compiler) here")
# (M, V, K): two rows; a partial block and a partial panel; one panel; two tasks of rows; 64
# rows of Qwen2.5's vocabulary; an odd K
SHAPES = [(2, 64, 32), (7, 100, 64), (5, 64, 64), (200, 320, 96), (64, 151936, 896),
          (9, 130, 33)]


def _unfused(x: torch.Tensor, packed: torch.Tensor, n: int,
             b: torch.Tensor | None = None) -> torch.Tensor:
    return KERNEL(x, packed, n, b).argmax(-1)


@pytest.mark.parametrize("m,vocab,k", SHAPES)
def test_equals_the_gemm_then_argmax(m, vocab, k, threads):
    gen = torch.Generator().manual_seed(m * vocab + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(vocab, k, generator=gen) / k ** 0.5).bfloat16()
    b = torch.randn(vocab, generator=gen).bfloat16()
    packed = KERNEL.pack(w)
    for bias in (None, b, b.float()):
        got = KERNEL.argmax(x, packed, vocab, bias)
        assert got.shape == (m,) and got.dtype == torch.int64
        assert torch.equal(got, _unfused(x, packed, vocab, bias))


def test_ties_go_to_the_first_column(threads):
    """Equal logits (duplicated weight rows: in one lane, other lanes of a panel, other panels
    and the other thread's half) and logits equal only after the rounding to bf16: the first
    column, as argmax."""
    gen = torch.Generator().manual_seed(1)
    k, vocab = 64, 512
    x = torch.randn(16, k, generator=gen).bfloat16()
    w = (torch.randn(vocab, k, generator=gen) / 8).bfloat16()
    best = _unfused(x, KERNEL.pack(w), vocab)
    for row in (0, 5, 15):
        top = best[row].item()
        for copy_to in (3, top % 16, top + 16, 40, 300, 511):
            if copy_to == top or copy_to >= vocab:
                continue
            w2 = w.clone()
            w2[copy_to] = w2[top]
            packed = KERNEL.pack(w2)
            assert KERNEL.argmax(x, packed, vocab)[row].item() == min(copy_to, top)
            assert torch.equal(KERNEL.argmax(x, packed, vocab), _unfused(x, packed, vocab))
    x1 = torch.zeros(2, k).bfloat16()
    x1[:, 0] = x1[:, 1] = 1.0
    w3 = torch.zeros(vocab, k).bfloat16()
    w3[3, 0], w3[130, 0], w3[130, 1] = 1.0, 1.0, 2 ** -12  # equal once rounded to bf16
    assert KERNEL.argmax(x1, KERNEL.pack(w3), vocab).tolist() == [3, 3]


def test_infinite_and_nan_logits():
    check_infinite_and_nan_logits(
        lambda x, w, bias: KERNEL.argmax(x, KERNEL.pack(w), w.shape[0], bias))


def test_strided_and_batched_x():
    w = torch.randn(200, 256).bfloat16()
    packed = KERNEL.pack(w)
    view = torch.randn(40, 300).bfloat16()[3:, 10:266]
    assert torch.equal(KERNEL.argmax(view, packed, 200), _unfused(view, packed, 200))
    x3 = torch.randn(2, 9, 256).bfloat16()
    assert torch.equal(KERNEL.argmax(x3, packed, 200),
                       _unfused(x3.view(18, 256), packed, 200).view(2, 9))


def test_the_route_takes_bf16_calls_of_two_rows_or_more():
    greedy = packed_greedy_head(2, True)
    w = torch.randn(64, 96).bfloat16()
    for rows, taken in ((1, False), (2, True), (300, True)):
        got = greedy(torch.randn(rows, 96).bfloat16(), w)
        assert (got is not None) == taken, rows
    assert greedy(torch.randn(8, 96), w.float()) is None  # float32: logits, then the sampler
    assert packed_greedy_head(2, False) is None


@pytest.fixture
def without_amx(monkeypatch):
    monkeypatch.setattr(cpu_platform, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})


def test_the_lm_head_takes_it_where_its_logits_are_whole(without_amx):
    backends = Backends.for_platform(CpuPlatform())
    assert backends.greedy_head is packed_greedy_head(2, True)
    check_lm_head_takes_it(backends)
