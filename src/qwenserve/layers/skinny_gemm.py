"""Decode-sized float GEMMs (a few rows of x) through the native skinny GEMM.

At 1-4 rows ``x @ W.T`` is bound by reading W, and ``native/csrc/gemv.cpp`` reads it once, in the
[N, K] layout the model keeps: no repacked copy, so weight accounting, tied embeddings and
sharded-state saving see the same tensor. float32 and bf16 have their own row limits (the
platform's ``skinny_gemm_max_rows`` and ``bf16_skinny_gemm_max_rows``: where each measured
faster than the GEMM behind it). Larger batches, other dtypes, and machines where the kernel does
not build (or, for bf16, has no AVX512-BF16) go to the GEMM behind it unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from qwenserve.native.gemm import Gemv, gemv

LinearFn = Callable[..., torch.Tensor]


@functools.cache
def with_skinny_gemm(linear: LinearFn, max_rows: int, bf16_max_rows: int = 0) -> LinearFn:
    """``linear`` with float32 calls of at most ``max_rows`` rows of x and bf16 calls of at most
    ``bf16_max_rows`` sent to the native kernel (the same function object for the same
    arguments: layers can compare it)."""
    kernel = gemv() if max(max_rows, bf16_max_rows) > 0 else None
    if kernel is None:
        return linear
    limits = {torch.float32: min(max_rows, Gemv.MAX_ROWS),
              torch.bfloat16: min(bf16_max_rows, Gemv.MAX_ROWS)}
    return functools.partial(_skinny_or, kernel, limits, linear)


def _skinny_or(kernel: Gemv, limits: dict[torch.dtype, int], linear: LinearFn, x: torch.Tensor,
               weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.numel() <= limits.get(x.dtype, 0) * x.shape[-1] and kernel.supports(x, weight):
        return kernel(x, weight, bias)
    return linear(x, weight, bias)
