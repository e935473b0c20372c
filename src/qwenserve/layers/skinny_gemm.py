"""Decode-sized float GEMMs (a few rows of x) through the native skinny GEMM.

At 1-4 rows ``x @ W.T`` is bound by reading W, and ``native/csrc/gemv.cpp`` reads it once, in the
[N, K] layout the model keeps: no repacked copy, so weight accounting, tied embeddings and
sharded-state saving see the same tensor. Larger batches, other dtypes, and machines where the
kernel does not build go to the platform's GEMM unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from qwenserve.native.kernels import Gemv, gemv

LinearFn = Callable[..., torch.Tensor]


@functools.cache
def with_skinny_gemm(linear: LinearFn, max_rows: int) -> LinearFn:
    """``linear`` with calls of at most ``max_rows`` rows of x sent to the native kernel
    (the same function object for the same arguments: layers can compare it)."""
    kernel = gemv() if max_rows > 0 else None
    if kernel is None:
        return linear
    return functools.partial(_skinny_or, kernel, min(max_rows, Gemv.MAX_ROWS), linear)


def _skinny_or(kernel: Gemv, max_rows: int, linear: LinearFn, x: torch.Tensor,
               weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.numel() <= max_rows * x.shape[-1] and kernel.supports(x, weight):
        out = kernel(x, weight)
        return out if bias is None else out.add_(bias)
    return linear(x, weight, bias)
