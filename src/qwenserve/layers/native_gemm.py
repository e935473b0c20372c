"""GEMMs routed by rows of x to the native kernels that measured faster than the platform's.

Float32, prefill and many-sequence decode: the native blocked GEMM below. bf16, decode-sized
batches on AMX CPUs: ``with_amx_gemm``, and an MLP's gate_up GEMM with its SiLU-and-mul in one
kernel: ``amx_gate_up_silu``; bf16 on AVX512-BF16 CPUs without AMX: ``with_packed_bf16_gemm``,
and the same fusion on its packed weights: ``packed_gate_up_silu``.

``native/csrc/sgemm.cpp`` computes ``x @ W.T + b`` from the [N, K] weight as the model keeps it
(only x is packed, per call), so weight accounting, tied embeddings and sharded-state saving see
one tensor. It replaces the platform GEMM from ``min_rows`` rows of x up to ``max_rows`` (0: no
limit), where it measured faster (docs/benchmarks.md, "Issue 19: native fp32 GEMM" and "float32
decode GEMMs in 16 lanes"); other row counts, other dtypes and machines where it does not build
keep the platform's GEMM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from qwenserve.native.gemm import Bgemm, Pbgemm, Sgemm, bgemm, pbgemm, sgemm
from qwenserve.platforms.cpu_packed_gemm import PackedFloatLinear

LinearFn = Callable[..., torch.Tensor]
# (x [..., K], the merged [gate | up] weight [2I, K], its bias [2I] or None) -> silu(gate) * up
# [..., I], or None where the fused kernel does not take the call
GateUpSiluFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"]
# (hidden [n, K], the LM head's weight [V, K]) -> [n] int64, the argmax of the logits the head's
# float GEMM gives, or None where the fused kernel does not take the call
GreedyHeadFn = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@functools.cache
def with_native_gemm(linear: LinearFn, min_rows: int, max_rows: int = 0) -> LinearFn:
    """``linear`` with float32 calls of ``min_rows`` to ``max_rows`` rows of x (0: any number
    from ``min_rows``) sent to the native GEMM (the same function object for the same arguments:
    layers can compare it); ``min_rows`` 0: never."""
    kernel = sgemm() if min_rows > 0 else None
    if kernel is None:
        return linear
    return functools.partial(_window_or, kernel, min_rows, max_rows or None, linear)


def _window_or(kernel: Sgemm | Bgemm, min_rows: int, max_rows: int | None, linear: LinearFn,
               x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel for calls of ``min_rows`` to ``max_rows`` rows of x (None: no limit) that it
    takes, with a bias (if any) in its dtype; ``linear`` for the rest."""
    if _takes(kernel, min_rows, max_rows, x, weight, bias):
        return kernel(x, weight, bias)
    return linear(x, weight, bias)


def _takes(kernel: Sgemm | Bgemm, min_rows: int, max_rows: int | None, x: torch.Tensor,
           weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``kernel`` takes this call: ``min_rows`` to ``max_rows`` rows of x (None: no
    limit), a pair it supports, a bias (if any) in its dtype."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (rows >= min_rows and (max_rows is None or rows <= max_rows)
            and kernel.supports(x, weight) and (bias is None or bias.dtype == kernel.dtype))


@functools.cache
def packed_bf16_kernel() -> tuple[Pbgemm, PackedFloatLinear] | None:
    """The packed bf16 GEMM and the one store of its packed weights (the GEMM route and the
    fused gate_up + SiLU share it: one packed copy of each weight), or None where it does not
    build."""
    kernel = pbgemm()
    if kernel is None:
        return None

    def run(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
        return kernel(x, packed, weight.shape[0], bias)

    return kernel, PackedFloatLinear(
        torch.bfloat16, kernel.pack, run,
        "bf16 GEMMs read each weight packed once for the native AVX512-BF16 kernel "
        "(native/csrc/pbgemm.cpp): a second copy of the bf16 weights in host memory "
        "(QWENSERVE_PACKED_BF16=0 turns this off)")


@functools.cache
def with_packed_bf16_gemm(linear: LinearFn, on: bool) -> LinearFn:
    """``linear`` with bf16 calls sent to ``native/csrc/pbgemm.cpp`` on a copy of each weight
    packed once (at its first call, which the worker's warm-up makes at load) into the kernel's
    64-column panels: AVX512-BF16 dot products near the cores' peak, 1.1-1.25x oneDNN's packed
    kernel at 16-64 rows and level at 512 on a Zen 5 EPYC, weights read from memory
    (docs/benchmarks.md, "A packed bf16 GEMM for AVX512-BF16 CPUs without AMX"). The plain
    weight stays the model's; weights the kernel does not take (views, other dtypes) go to
    ``linear``, so the platform's own packing happens only for them. ``on`` False or no kernel:
    ``linear`` itself."""
    packed = packed_bf16_kernel() if on else None
    if packed is None:
        return linear
    return functools.partial(_packed_or, packed[1], linear)


@functools.cache
def packed_gate_up_silu(min_rows: int, on: bool) -> GateUpSiluFn | None:
    """An MLP's gate_up GEMM and SiLU-and-mul as one packed-GEMM kernel for bf16 calls of
    ``min_rows`` rows or more (``Pbgemm.silu_mul``, on the packed copy ``with_packed_bf16_gemm``
    keeps: the unfused path's result bit for bit, without its [rows, 2I] intermediate and the
    pass over it), or None where that route is off (``on`` False, no kernel)."""
    packed = packed_bf16_kernel() if on else None
    if packed is None:
        return None
    return functools.partial(_packed_silu_mul, *packed, min_rows)


@functools.cache
def packed_greedy_head(min_rows: int, on: bool) -> GreedyHeadFn | None:
    """A greedy step's LM head as one packed-GEMM kernel for bf16 calls of ``min_rows`` rows or
    more (``Pbgemm.argmax``: the token ids the packed GEMM and an argmax give, without writing
    the [rows, vocab] logits and reading them back), on the packed copy ``with_packed_bf16_gemm``
    keeps, or None where that route is off. The rows are those the GEMM route sends to the same
    kernel, so the logits it ranks are bit for bit the ones the sampler would see."""
    packed = packed_bf16_kernel() if on else None
    if packed is None:
        return None
    return functools.partial(_packed_argmax, *packed, min_rows)


def _packed_takes(packed: PackedFloatLinear, min_rows: int, x: torch.Tensor,
                  weight: torch.Tensor) -> bool:
    """Whether a packed-GEMM fusion takes this call: ``min_rows`` rows of x or more, in the
    dtype and layout the packed store keeps."""
    return x.numel() // max(x.shape[-1], 1) >= min_rows and packed.supports(x, weight)


def _packed_argmax(kernel: Pbgemm, packed: PackedFloatLinear, min_rows: int, x: torch.Tensor,
                   weight: torch.Tensor) -> torch.Tensor | None:
    if not _packed_takes(packed, min_rows, x, weight):
        return None
    return kernel.argmax(x, packed.packed(weight), weight.shape[0])


def _packed_silu_mul(kernel: Pbgemm, packed: PackedFloatLinear, min_rows: int, x: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor | None:
    if not (_packed_takes(packed, min_rows, x, weight)
            and kernel.silu_mul_takes(weight.shape[0])):
        return None
    return kernel.silu_mul(x, packed.packed(weight), weight.shape[0], bias)


def _packed_or(packed: PackedFloatLinear, linear: LinearFn, x: torch.Tensor,
               weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if packed.supports(x, weight):
        return packed(x, weight, bias)
    return linear(x, weight, bias)


@functools.cache
def with_amx_gemm(linear: LinearFn, max_rows: int) -> LinearFn:
    """``linear`` with bf16 calls of 1 to ``max_rows`` rows of x sent to ``native/csrc/bgemm.cpp``
    (AMX tiles on the plain weight: 1.1-2x oneDNN's packed bf16 kernels per shape at 1-32 rows,
    docs/benchmarks.md "bf16 decode GEMMs on AMX tiles"); ``max_rows`` 0 or no AMX: ``linear``
    itself (the same function object for the same arguments)."""
    kernel = bgemm() if max_rows > 0 else None
    if kernel is None:
        return linear
    return functools.partial(_window_or, kernel, 1, max_rows, linear)


@functools.cache
def amx_gate_up_silu(min_rows: int, max_rows: int) -> GateUpSiluFn | None:
    """An MLP's gate_up GEMM and SiLU-and-mul as one AMX kernel for bf16 calls of ``min_rows``
    to ``max_rows`` rows of x (``Bgemm.silu_mul``: the unfused path's result bit for bit, without
    its [rows, 2I] intermediate and the pass over it; docs/benchmarks.md, "SiLU-and-mul in the
    AMX GEMM's epilogue"), or None where there is no AMX kernel (``max_rows`` 0 included)."""
    return _amx_fused("silu_mul", min_rows, max_rows)


@functools.cache
def amx_greedy_head(min_rows: int, max_rows: int) -> GreedyHeadFn | None:
    """A greedy step's LM head as one AMX kernel for bf16 calls of ``min_rows`` to ``max_rows``
    rows (``Bgemm.argmax``: the token ids the GEMM and an argmax give, without writing the
    [rows, vocab] logits and reading them back), or None where there is no AMX kernel. The rows
    are those ``with_amx_gemm`` sends to the same GEMM, so the logits it ranks are bit for bit
    the ones the sampler would see."""
    return _amx_fused("argmax", min_rows, max_rows)


def _amx_fused(method: str, min_rows: int, max_rows: int
               ) -> Callable[..., torch.Tensor | None] | None:
    """``Bgemm.<method>`` (a GEMM with a fused epilogue) for the bf16 calls of ``min_rows`` to
    ``max_rows`` rows it takes, returning None for the rest; None without the AMX kernel."""
    kernel = bgemm() if max_rows > 0 else None
    if kernel is None:
        return None
    return functools.partial(_fused_window, kernel, getattr(kernel, method), min_rows, max_rows)


def _fused_window(kernel: Bgemm, fused: Callable[..., torch.Tensor], min_rows: int,
                  max_rows: int, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor | None:
    if _takes(kernel, min_rows, max_rows, x, weight, bias):
        return fused(x, weight, bias)
    return None
