"""INT8 quantize / matmul primitives in plain PyTorch, and the int8 GEMM dispatch.

The GEMM goes to the platform (``Platform.int8_scaled_mm``: oneDNN ``torch._int_mm`` on CPU,
cuBLASLt on CUDA, ``npu_quant_matmul`` on Ascend); where it has none, the weight is dequantized on
the fly and multiplied in float32 (``int8_mm_reference``, also the oracle in the tests). Both
compute the same W8A8 maths, so a platform changes speed, not results (up to fp32 rounding).

Symmetric int8 here means x ~= x_q * scale with x_q in [-128, 127] and scale = absmax / 127.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from qwenserve.platforms.base import Platform

_TINY = 1e-10  # scale floor: all-zero rows quantize to zeros instead of dividing by zero
_ROUNDER = 1.5 * 2**23  # v + R - R rounds half to even in float32 for |v| < 2**22


def _to_int8(v: torch.Tensor) -> torch.Tensor:
    """Clamp to [-128, 127], round half to even (as torch.round), cast. float32 v, in place.

    Adding and removing 1.5 * 2**23 rounds exactly; torch.round gives the same integers but opens
    a parallel region even for one decode row, which on a busy CPU costs a scheduler slice per
    call (measured 12 ms against 7 us for a [1, 4864] row with 2 threads on a loaded host)."""
    return v.clamp_(-128, 127).add_(_ROUNDER).sub_(_ROUNDER).to(torch.int8)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per row: x [M, K] -> (x_q [M, K] int8, scale [M, 1] float32)."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp_(min=_TINY).div_(127.0)  # [M, 1]
    # times the reciprocal, as vLLM's kernels: a multiply vectorises 4-8x faster than a divide
    return _to_int8(x32 * scale.reciprocal()), scale


def quantize_static(x: torch.Tensor, inv_scale: float, offset: float) -> torch.Tensor:
    """Static per-tensor int8 with a zero point, as ModelSlim calibrates it (npu_quantize):
    x_q = clamp(round(x / scale + offset), -128, 127). x [M, K] -> x_q [M, K] int8."""
    return _to_int8(x.float() * inv_scale + offset)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: w [N, K] -> (w_q [N, K] int8, scale [N, 1] float32).

    Each row is quantized on its own, so the q/k/v (or gate/up) shards of a merged layer can be
    quantized one at a time as they arrive and give the same result as the whole matrix."""
    w32 = weight.float()
    scale = w32.abs().amax(dim=1, keepdim=True).clamp_(min=_TINY).div_(127.0)  # [N, 1]
    return torch.round(w32 / scale).clamp_(-127, 127).to(torch.int8), scale


def int8_mm_reference(a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                      token_scale: torch.Tensor | None = None,
                      int_bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(a_q @ w_q.T + int_bias) * scale * token_scale`` by dequantizing on the fly (float32)."""
    acc = a_q.to(torch.float32) @ w_q.to(torch.float32).t()  # [M, N]
    if int_bias is not None:
        acc += int_bias
    acc *= scale
    if token_scale is not None:
        acc *= token_scale
    return acc.to(out_dtype)


class RowQuantizer(Protocol):
    """Faster per-token halves of W8A8 (``native.elementwise.Elementwise`` on CPU): the same
    integers and scales as ``quantize_per_token`` for the tensors ``supports`` accepts, and
    ``(acc * row_scale).to(out_dtype)`` in one pass."""

    def supports(self, x: torch.Tensor) -> bool: ...

    def quantize_per_token(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def scale_rows(self, acc: torch.Tensor, row_scale: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor: ...

    def silu_mul_quantize(self, acc: torch.Tensor, row_scale: torch.Tensor,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None: ...


class Int8Matmul:
    """The int8 GEMM of one platform, with the dequantizing fallback, and the per-token
    quantization of its activations. Up to the platform's ``int8_skinny_max_rows`` rows it runs
    the native kernel (``native/csrc/gemv.cpp``: exact int32 sums, read from the [N, K] int8
    weight as stored) where that builds; above them the AMX-INT8 kernel (its window). Where
    the platform has the packed VNNI kernel (``Platform.packed_int8_gemm``) it takes every row
    count, the skinny kernel only what it leaves (views). Both scale in their epilogues."""

    def __init__(self, platform: Platform | None, quantizer: RowQuantizer | None = None) -> None:
        self.platform = platform
        self.quantizer = quantizer
        self.skinny_rows = platform.int8_skinny_max_rows() if platform is not None else 0
        self.skinny = None
        if self.skinny_rows > 0:
            from qwenserve.native.gemm import gemv

            self.skinny = gemv()
        # above the skinny rows: the AMX-INT8 kernel (scaling and bias in its epilogue) up to
        # the platform's window, where it runs
        self.amx_rows = platform.amx_int8_max_rows if platform is not None else 0
        self.amx = None
        if self.amx_rows > 0:
            from qwenserve.native.gemm import igemm

            self.amx = igemm()
        # the packed VNNI kernel (scaling and bias in its epilogue) on CPUs without AMX-INT8,
        # where it builds
        self.packed = None
        if platform is not None and platform.packed_int8_gemm():
            from qwenserve.native.gemm import pigemm
            from qwenserve.platforms.cpu_packed_gemm import PackedScaledInt8

            kernel = pigemm()
            self.packed = None if kernel is None else PackedScaledInt8(kernel)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantize_per_token(x)``, x [M, K], through the quantizer where it takes x: one pass
        instead of about ten torch ops (benchmarks.md, "INT8 on AMX")."""
        if self.quantizer is not None and x.dim() == 2 and self.quantizer.supports(x):
            return self.quantizer.quantize_per_token(x)
        return quantize_per_token(x)

    def _skinny_takes(self, a_q: torch.Tensor, w_q: torch.Tensor) -> bool:
        return (self.skinny is not None and a_q.shape[0] <= self.skinny_rows
                and self.skinny.supports(a_q, w_q))

    def _scaling_kernel(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                        token_scale: torch.Tensor | None, int_bias: torch.Tensor | None,
                        out_dtype: torch.dtype, bias: torch.Tensor | None = None
                        ) -> torch.Tensor | None:
        """The result of a native kernel with the scaling in its epilogue (the AMX-INT8 one
        within its window, the packed VNNI one at any rows), or None where neither takes the
        call."""
        if self.amx is not None and a_q.shape[0] <= self.amx_rows:
            return self.amx.scaled(a_q, w_q, scale, token_scale, int_bias, out_dtype, bias)
        if self.packed is not None:
            return self.packed.scaled(a_q, w_q, scale, token_scale, int_bias, out_dtype, bias)
        return None

    def _quantizer_scales(self, rows: int) -> bool:
        return self.platform is not None and self.quantizer is not None and rows > 1

    def scales_apart(self, rows: int) -> bool:
        """Whether ``__call__`` runs this many rows as the platform's GEMM with the channel
        scales (``accumulate``) and then the quantizer's per-token pass: the form a caller may
        fuse the per-token pass into its next kernel from."""
        skinny_may_take = self.skinny is not None and rows <= self.skinny_rows
        return self._quantizer_scales(rows) and not skinny_may_take

    def gate_up_silu(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                     token_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
        """``silu_and_mul`` of an MLP's W8A8 gate_up GEMM (w_q [2I, K]: gate rows, then up
        rows) in the packed VNNI kernel's epilogue -> [M, I] in out_dtype, bit for bit the
        GEMM and the SiLU-and-mul kernel in turn; None where it does not take the call."""
        if self.packed is None:
            return None
        return self.packed.silu_mul(a_q, w_q, scale, token_scale, out_dtype)

    def accumulate(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                   int_bias: torch.Tensor | None) -> torch.Tensor | None:
        """``(a_q @ w_q.T + int_bias) * scale`` in float32 through the platform's GEMM (the
        per-token scale not yet applied), or None where the platform has no int8 GEMM."""
        assert self.platform is not None
        out = self._scaling_kernel(a_q, w_q, scale, None, int_bias, torch.float32)
        if out is not None:
            return out
        return self.platform.int8_scaled_mm(a_q, w_q, scale, None, int_bias, torch.float32)

    def __call__(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                 token_scale: torch.Tensor | None, int_bias: torch.Tensor | None,
                 out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
        """a_q [M, K] int8, w_q [N, K] int8, scale [N], token_scale [M, 1] -> [M, N], plus
        ``bias`` [N] (a layer's float bias, added to the result in out_dtype) if given."""
        # the packed VNNI kernel first, at any rows: 1.13x the skinny GEMV at one row and 1.27x
        # at two over a 24-layer stack of W8A8 weights (Zen 5 EPYC); the skinny GEMV keeps what
        # it does not take (views: one MoE expert's slice of the stacked weights)
        if self.packed is not None and (out := self.packed.scaled(
                a_q, w_q, scale, token_scale, int_bias, out_dtype, bias)) is not None:
            return out
        out = None
        if self._skinny_takes(a_q, w_q):
            from qwenserve.platforms.base import int32_epilogue

            out = self.skinny.int8_scaled(a_q, w_q, scale, token_scale, int_bias, out_dtype,
                                          bias)
            if out is not None:
                return out  # the bias added in the kernel (decode steps stay native calls)
            # an out_dtype or scales the kernel does not take
            out = int32_epilogue(self.skinny(a_q, w_q), scale, token_scale, int_bias, out_dtype)
        elif (scaled := self._scaling_kernel(a_q, w_q, scale, token_scale, int_bias, out_dtype,
                                             bias)) is not None:
            return scaled
        elif token_scale is not None and self._quantizer_scales(a_q.shape[0]):
            # the platform scales per channel, the quantizer per token and casts: one pass
            acc = self.accumulate(a_q, w_q, scale, int_bias)
            if acc is not None:
                out = self.quantizer.scale_rows(acc, token_scale, out_dtype)
        elif self.platform is not None:
            out = self.platform.int8_scaled_mm(a_q, w_q, scale, token_scale, int_bias, out_dtype)
        if out is None:
            out = int8_mm_reference(a_q, w_q, scale, token_scale, int_bias, out_dtype)
        return out if bias is None else out + bias
