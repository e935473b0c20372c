"""Typed Python face of the fused elementwise kernels (norms, SiLU-and-mul, rotary, int8
per-token quantization)."""

from __future__ import annotations

import ctypes
import os
import platform

import torch

from qwenserve.native.build import CSRC, DEFAULT_CFLAGS, load_library
from qwenserve.native.build import F32 as _F
from qwenserve.native.build import I64 as _I
from qwenserve.native.build import PTR as _P


class Elementwise:
    """``csrc/elementwise.cpp``: residual-add + RMSNorm, SiLU-and-mul, rotary, per-token int8
    quantization and the per-token rescale of an int8 GEMM, in one pass each. Inputs are fp32 or
    bf16 CPU tensors whose last dimension is contiguous; ``supports`` says which, and callers
    run the PyTorch reference for anything else."""

    DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm, self._act, self._rot, self._quant, self._scale = {}, {}, {}, {}, {}
        self._act_quant, self._gate = {}, {}
        for dtype, tag in self.DTYPES.items():
            fn = getattr(lib, f"rms_norm_{tag}")
            fn.argtypes = [_P] * 5 + [_I] * 7 + [_F, ctypes.c_int]
            fn.restype = None
            self._norm[dtype] = fn
            fn = getattr(lib, f"silu_and_mul_{tag}")
            fn.argtypes = [_P, _P, _I, _I, _I]
            fn.restype = None
            self._act[dtype] = fn
            fn = getattr(lib, f"rotary_{tag}")
            fn.argtypes = [_P] * 5 + [_I] * 8
            fn.restype = ctypes.c_int
            self._rot[dtype] = fn
            fn = getattr(lib, f"quantize_rows_{tag}")
            fn.argtypes = [_P, _P, _P, _I, _I, _I]
            fn.restype = None
            self._quant[dtype] = fn
            fn = getattr(lib, f"scale_rows_{tag}")
            fn.argtypes = [_P, _P, _P, _I, _I]
            fn.restype = None
            self._scale[dtype] = fn
            fn = getattr(lib, f"silu_mul_quantize_{tag}")
            fn.argtypes = [_P, _P, _P, _P, _I, _I]
            fn.restype = None
            self._act_quant[dtype] = fn
            fn = getattr(lib, f"sigmoid_gate_{tag}")
            fn.argtypes = [_P] * 3 + [_I] * 7
            fn.restype = None
            self._gate[dtype] = fn
        self._silu_table = lib.silu_use_table
        self._silu_table.argtypes = [ctypes.c_int]
        self._silu_table.restype = ctypes.c_int

    def use_silu_table(self, on: bool) -> bool | None:
        """Whether bf16 SiLU-and-mul looks SiLU up in a table (the default on Intel CPUs, whose
        gathers are fast) or computes it (elsewhere): the same values either way; a switch for
        tests and benchmarks, process-wide. Returns the previous choice, None where the build
        has no table (no AVX512-BF16)."""
        previous = self._silu_table(int(on))
        return None if previous < 0 else bool(previous)

    def supports(self, x: torch.Tensor) -> bool:
        # called per layer and op: is_cpu, not x.device (which builds a device object)
        return x.is_cpu and x.dtype in self._norm and x.stride(-1) == 1

    @staticmethod
    def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
        """x [..., h] as (n_outer, n_inner, outer stride, inner stride) over its rows: 2-D
        tensors and 3-D ones (per-head norms of q/k views) in place, others made contiguous."""
        if x.dim() == 2:
            return x.shape[0], 1, x.stride(0), 0
        if x.dim() == 3:
            return x.shape[0], x.shape[1], x.stride(0), x.stride(1)
        raise ValueError(f"rms_norm: expected a 2-D or 3-D tensor, got shape {tuple(x.shape)}")

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, zero_centred: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """RMSNorm over the last dim of x (after adding ``residual``, same shape) ->
        (normed, x + residual or None), both new contiguous tensors."""
        # Called for every decoder norm of every step: views, copies and extra allocations only
        # where x needs them (a one-row call went 16 -> 6 us for ~1 us of kernel work).
        shape = x.shape
        if x.dim() not in (2, 3):
            x = x.reshape(-1, shape[-1])
            residual = None if residual is None else residual.reshape(-1, shape[-1])
        h = x.shape[-1]
        if not weight.is_contiguous():
            weight = weight.contiguous()
        assert weight.dtype == x.dtype and weight.numel() == h
        n_outer, n_inner, x_so, x_si = self._rows(x)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        res_out, r_so, r_si, res_ptr = None, 0, 0, None
        if residual is not None:
            assert residual.shape == x.shape and residual.dtype == x.dtype
            if residual.stride(-1) != 1:
                residual = residual.contiguous()
            _, _, r_so, r_si = self._rows(residual)
            res_out = torch.empty_like(out)
            res_ptr = residual.data_ptr()
        self._norm[x.dtype](out.data_ptr(), None if res_out is None else res_out.data_ptr(),
                            x.data_ptr(), res_ptr, weight.data_ptr(), n_outer, n_inner, x_so,
                            x_si, r_so, r_si, h, eps, int(zero_centred))
        if out.shape != shape:
            out = out.view(shape)
            res_out = None if res_out is None else res_out.view(shape)
        return out, res_out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2*I] (gate then up) -> silu(gate) * up, [..., I]."""
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        inter = flat.shape[-1] // 2
        out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
        self._act[x.dtype](out.data_ptr(), flat.data_ptr(), flat.shape[0], inter,
                           flat.stride(0))
        return out

    def sigmoid_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [T, H, D] of one dtype (heads at any strides, each head's D values
        contiguous) -> x * sigmoid(gate) as a new contiguous [T, H * D]."""
        assert x.shape == gate.shape and x.dim() == 3 and x.dtype == gate.dtype
        if x.stride(-1) != 1 or gate.stride(-1) != 1:
            raise ValueError("sigmoid_gate: each head's values must be contiguous")
        tokens, heads, d = x.shape
        out = torch.empty(tokens, heads * d, dtype=x.dtype)
        self._gate[x.dtype](out.data_ptr(), x.data_ptr(), gate.data_ptr(), tokens, heads, d,
                            x.stride(0), x.stride(1), gate.stride(0), gate.stride(1))
        return out

    def quantize_per_token(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic symmetric int8 per row, as ``quantization.kernels.quantize_per_token``:
        x [M, K] -> (x_q [M, K] int8, scale [M, 1] float32)."""
        if x.dim() != 2:
            raise ValueError(f"quantize_per_token: expected [M, K], got {tuple(x.shape)}")
        rows, k = x.shape
        x_q = torch.empty(rows, k, dtype=torch.int8)
        scale = torch.empty(rows, 1)
        self._quant[x.dtype](x_q.data_ptr(), scale.data_ptr(), x.data_ptr(), rows, k,
                             x.stride(0))
        return x_q, scale

    def silu_mul_quantize(self, acc: torch.Tensor, row_scale: torch.Tensor,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``quantize_per_token(silu_and_mul(scale_rows(acc, row_scale, dtype)))`` in one pass,
        to the same integers and scales: acc [M, 2I] float32 contiguous (the gate_up GEMM with
        its channel scales), row_scale [M, 1] -> (x_q [M, I] int8, scale [M, 1] float32); None
        for tensors the kernel does not take."""
        if (acc.dtype != torch.float32 or acc.dim() != 2 or not acc.is_contiguous()
                or acc.shape[1] % 2 or dtype not in self._act_quant):
            return None
        rows, inter = acc.shape[0], acc.shape[1] // 2
        row_scale = row_scale.float().contiguous()
        assert row_scale.numel() == rows
        x_q = torch.empty(rows, inter, dtype=torch.int8)
        scale = torch.empty(rows, 1)
        self._act_quant[dtype](x_q.data_ptr(), scale.data_ptr(), acc.data_ptr(),
                               row_scale.data_ptr(), rows, inter)
        return x_q, scale

    def scale_rows(self, acc: torch.Tensor, row_scale: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
        """``(acc * row_scale).to(out_dtype)`` in one pass: acc [M, N] float32 (contiguous;
        overwritten when out_dtype is float32), row_scale [M, 1] float32."""
        if (acc.dtype != torch.float32 or acc.dim() != 2 or not acc.is_contiguous()
                or out_dtype not in self._scale):
            return (acc * row_scale).to(out_dtype)
        row_scale = row_scale.float().contiguous()
        assert row_scale.numel() == acc.shape[0]
        out = acc if out_dtype == torch.float32 else torch.empty(acc.shape, dtype=out_dtype)
        self._scale[out_dtype](out.data_ptr(), acc.data_ptr(), row_scale.data_ptr(),
                               acc.shape[0], acc.shape[1])
        return out

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> None:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (each head's dims contiguous) by the
        fp32 tables cos/sin [max_position, rotary_dim] at ``positions`` [T]."""
        assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous()
        assert sin.is_contiguous() and q.dtype == k.dtype
        d = q.shape[-1]
        for t in (q, k):
            if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != d:
                raise ValueError(f"rotary: heads of shape {tuple(t.shape)} strides "
                                 f"{t.stride()} are not contiguous rows")
        pos = positions if positions.dtype == torch.int64 else positions.long()
        pos = pos.contiguous()
        status = self._rot[q.dtype](q.data_ptr(), k.data_ptr(), pos.data_ptr(), cos.data_ptr(),
                                    sin.data_ptr(), q.shape[0], q.stride(0), k.stride(0),
                                    q.shape[1], k.shape[1], d, rotary_dim, cos.shape[0])
        if status == 1:
            raise ValueError(f"rotary: rotary_dim {rotary_dim} must be even and <= {d}")
        if status == 2:
            raise IndexError(f"rotary: a position is outside the table of {cos.shape[0]} "
                             f"(max_model_len)")


# GCC vectorises with 256-bit registers on AVX512 CPUs unless told otherwise; 512-bit ones
# made bf16 SiLU-and-mul [64, 9728] 333 -> 241 us (Sapphire Rapids, 1 thread). x86 only (an
# unknown flag elsewhere); where AVX512 is absent it changes nothing.
WIDE_VECTORS = ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()


def elementwise() -> Elementwise | None:
    """The fused elementwise kernels, or None (logged) where they cannot be built. No fast-math
    flags, and no contraction into FMAs: the rotary results equal the reference's exactly."""
    lib = load_library("qwenserve_elementwise", [os.path.join(CSRC, "elementwise.cpp")],
                       cflags=(*DEFAULT_CFLAGS, *WIDE_VECTORS, "-fno-math-errno",
                               "-fno-trapping-math", "-ffp-contract=off"))
    return None if lib is None else Elementwise(lib)
