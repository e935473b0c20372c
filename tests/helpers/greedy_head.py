"""Checks shared by the fused greedy LM heads' tests (the AMX GEMM's and the packed GEMM's):
``argmax(x, w, bias)`` gives each row's token from the logits its GEMM computes, and an LM head
built with the platform's backends takes the fused head where its logits are whole."""

from __future__ import annotations

from collections.abc import Callable

import torch

from qwenserve.layers.backends import Backends
from qwenserve.layers.embedding import ParallelLMHead

Argmax = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def check_infinite_and_nan_logits(argmax: Argmax) -> None:
    """A -inf bias leaves its column out; columns past a NaN still win (NaN never compares
    larger); a row of -inf everywhere gives column 0 as argmax would."""
    k, vocab = 32, 96
    x = torch.ones(3, k).bfloat16()
    w = torch.zeros(vocab, k).bfloat16()
    w[10] = 0.5
    w[70] = 0.25
    bias = torch.zeros(vocab).bfloat16()
    assert argmax(x, w, bias).tolist() == [10] * 3
    bias[10] = -float("inf")
    assert argmax(x, w, bias).tolist() == [70] * 3
    bias[20] = float("nan")
    assert argmax(x, w, bias).tolist() == [70] * 3
    assert argmax(x, w, torch.full((vocab,), -float("inf")).bfloat16()).tolist() == [0] * 3


def check_lm_head_takes_it(backends: Backends) -> torch.Tensor:
    """A bf16 LM head with ``backends``' greedy head: 12 rows give the tokens its logits' argmax
    gives, one row (the skinny GEMM's) none; returns the rows, for the caller's own checks."""
    head = ParallelLMHead(320, 64, torch.bfloat16, float_linear=backends.float_linear,
                          greedy_head=backends.greedy_head)
    head.weight.data.copy_(torch.randn(320, 64) / 8)
    hidden = torch.randn(12, 64).bfloat16()
    got = head.greedy_tokens(hidden)
    assert got is not None
    assert torch.equal(got, head.compute_logits(hidden, None).argmax(-1))
    assert head.greedy_tokens(hidden[:1]) is None  # one row: the skinny GEMM's logits
    return hidden
