"""Checks shared by the fused greedy LM heads' tests (the AMX GEMM's and the packed GEMM's):
``argmax(x, w, bias)`` gives each row's token from the logits its GEMM computes."""

from __future__ import annotations

from collections.abc import Callable

import torch

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
