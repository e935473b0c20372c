"""A greedy LM head in one AMX kernel (``Bgemm.argmax``, native/csrc/bgemm.cpp): each row's
argmax over the logits the same kernel's GEMM gives, against that GEMM followed by
``torch.argmax``: equal at one and several 16-row blocks of x, partial blocks, a panel per
thread and fewer panels than threads, ties (the first column wins), -inf and NaN logits, bias,
strided x, one and two threads; and the seam: which calls the route takes, and the LM head's
``greedy_tokens`` (None where it must not run)."""

from __future__ import annotations

import pytest
import torch

from helpers.greedy_head import check_infinite_and_nan_logits, check_lm_head_takes_it
from qwenserve.distributed.parallel_group import ParallelGroup
from qwenserve.layers.backends import Backends
from qwenserve.layers.embedding import ParallelLMHead
from qwenserve.layers.native_gemm import amx_greedy_head
from qwenserve.native.gemm import bgemm
from qwenserve.platforms.cpu import CpuPlatform

KERNEL = bgemm()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no AMX tiles (or no compiler) here")
# (M, V, K): two rows; a partial block; one panel (fewer panels than threads); a pass and a
# bit; 64 rows of Qwen2.5's vocabulary; the route's last row count
SHAPES = [(2, 64, 32), (7, 96, 64), (5, 32, 64), (33, 160, 128), (64, 151936, 896),
          (96, 4096, 256)]


def _unfused(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return KERNEL(x, w, b).argmax(-1)


@pytest.mark.parametrize("m,vocab,k", SHAPES)
def test_equals_the_gemm_then_argmax(m, vocab, k, threads):
    gen = torch.Generator().manual_seed(m * vocab + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(vocab, k, generator=gen) / k ** 0.5).bfloat16()
    b = torch.randn(vocab, generator=gen).bfloat16()
    for bias in (None, b):
        got = KERNEL.argmax(x, w, bias)
        assert got.shape == (m,) and got.dtype == torch.int64
        assert torch.equal(got, _unfused(x, w, bias))


def test_ties_go_to_the_first_column(threads):
    """Equal logits (duplicated weight rows, in one panel and across panels and threads' halves)
    and logits that are equal only after the rounding to bf16: the first column, as argmax."""
    gen = torch.Generator().manual_seed(1)
    k, vocab = 64, 256
    x = torch.randn(16, k, generator=gen).bfloat16()
    w = (torch.randn(vocab, k, generator=gen) / 8).bfloat16()
    best = KERNEL(x, w).argmax(-1)
    for row in (0, 5, 15):
        top = best[row].item()
        for copy_to in (3, 40, 200, 255):  # before and after it, near and far
            w2 = w.clone()
            w2[copy_to] = w2[top]
            assert KERNEL.argmax(x, w2)[row].item() == min(copy_to, top)
            assert torch.equal(KERNEL.argmax(x, w2), _unfused(x, w2))
    # rows 3 and 130 give the same bf16 logit for x row 0 though their fp32 sums differ
    x1 = torch.zeros(2, k).bfloat16()
    x1[:, 0] = 1.0
    w3 = torch.zeros(vocab, k).bfloat16()
    w3[3, 0], w3[130, 0], w3[130, 1] = 1.0, 1.0, 2 ** -12
    x1[:, 1] = 1.0
    assert KERNEL.argmax(x1, w3).tolist() == [3, 3] == _unfused(x1, w3).tolist()


def test_infinite_and_nan_logits():
    check_infinite_and_nan_logits(KERNEL.argmax)


def test_strided_and_batched_x():
    w = torch.randn(128, 256).bfloat16()
    view = torch.randn(40, 300).bfloat16()[3:, 10:266]
    assert torch.equal(KERNEL.argmax(view, w), _unfused(view, w))
    x3 = torch.randn(2, 9, 256).bfloat16()
    assert torch.equal(KERNEL.argmax(x3, w), _unfused(x3.view(18, 256), w).view(2, 9))


def test_the_route_takes_the_amx_gemm_rows_only():
    greedy = amx_greedy_head(2, 96)
    w = torch.randn(64, 96).bfloat16()
    for rows, taken in ((1, False), (2, True), (96, True), (97, False)):
        got = greedy(torch.randn(rows, 96).bfloat16(), w)
        assert (got is not None) == taken, rows
    assert greedy(torch.randn(8, 96), w.float()) is None  # float32: logits, then the sampler
    assert greedy(torch.randn(8, 96).bfloat16(), torch.randn(48, 96).bfloat16()) is None
    assert amx_greedy_head(2, 0) is None
    assert Backends.for_platform(CpuPlatform()).greedy_head is amx_greedy_head(2, 96)


def test_the_lm_head_takes_it_where_its_logits_are_whole():
    backends = Backends.for_platform(CpuPlatform())
    hidden = check_lm_head_takes_it(backends)
    assert ParallelLMHead(320, 64, torch.bfloat16).greedy_tokens(hidden) is None  # no kernel
    sharded = ParallelLMHead(320, 64, torch.bfloat16, tp=ParallelGroup(0, 2),
                             greedy_head=backends.greedy_head)
    assert sharded.greedy_tokens(hidden) is None  # the vocabulary's gather must run
