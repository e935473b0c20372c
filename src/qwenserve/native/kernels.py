"""Typed Python faces of the native kernels; each library is built on first use."""

from __future__ import annotations

import ctypes
import os

import torch

from qwenserve.native.build import DEFAULT_CFLAGS, load_library

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# Vectorised expf (glibc's libmvec) in the softmax; the kernels test NaN by its bits.
# The parts of -ffast-math that let GCC vectorise the reductions, not -ffast-math itself: before
# GCC 13 that also links crtfastmath.o into shared objects, which turns on flush-to-zero and
# denormals-are-zero for the whole process when the library loads (torch's arithmetic included).
# No -ffinite-math-only either: the kernels mask with -inf.
FAST_MATH = ("-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
             "-freciprocal-math")


class DecodeAttention:
    """``csrc/decode_attention.cpp``: paged decode attention reading the cache in place."""

    DTYPES = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {}
        for dtype, name in self.DTYPES.items():
            fn = getattr(lib, name)
            fn.argtypes = [_P, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F]
            fn.restype = ctypes.c_int
            self._fns[dtype] = fn

    def supports(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return (q.dtype in self._fns and kv_cache.dtype == q.dtype and q.device.type == "cpu"
                and kv_cache.is_contiguous() and q.shape[-1] % 8 == 0)

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
        """q [n, Hq, D], kv_cache [2, num_slots, Hkv, D] (contiguous), block_tables
        [n, W] int64, ctx_lens [n] int64 -> [n, Hq, D]."""
        q = q.contiguous()
        tables, lens = block_tables.contiguous(), ctx_lens.contiguous()
        assert tables.dtype == lens.dtype == torch.int64 and tables.shape[0] == q.shape[0]
        n, hq, d = q.shape
        hkv = kv_cache.shape[2]
        out = torch.empty_like(q)
        status = self._fns[q.dtype](out.data_ptr(), q.data_ptr(), kv_cache[0].data_ptr(),
                                    kv_cache[1].data_ptr(), tables.data_ptr(),
                                    tables.shape[1],
                                    lens.data_ptr(), n, hq, hkv, d, block_size, scale)
        if status:
            raise ValueError(f"paged_decode: unsupported shape q {tuple(q.shape)}, "
                             f"kv_cache {tuple(kv_cache.shape)}")
        return out


def decode_attention() -> DecodeAttention | None:
    """The decode-attention kernel, or None (logged) where it cannot be built."""
    lib = load_library("qwenserve_decode_attention", [os.path.join(CSRC, "decode_attention.cpp")],
                       cflags=(*DEFAULT_CFLAGS, *FAST_MATH))
    return None if lib is None else DecodeAttention(lib)


class Gemv:
    """``csrc/gemv.cpp``: ``x @ w.T`` for a few rows of x (decode), streaming the [N, K] weight
    once; float32, and int8 x int8 -> int32 (exact, as ``torch._int_mm``)."""

    MAX_ROWS = 4  # fp32 decode rows; from 8 rows oneDNN's blocked GEMM wins (benchmarks.md)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._f32, self._s8 = lib.gemv_f32, lib.gemv_s8s32
        for fn in (self._f32, self._s8):
            fn.argtypes = [_P, _P, _P, _I, _I, _I]
            fn.restype = ctypes.c_int

    def supports(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether ``__call__`` takes this pair: CPU, same dtype, a contiguous [N, K] weight."""
        return (x.dtype == w.dtype and x.dtype in (torch.float32, torch.int8)
                and x.device.type == "cpu" and w.device.type == "cpu" and w.dim() == 2
                and x.shape[-1] == w.shape[1] and x.numel() > 0 and w.shape[0] > 0
                and w.shape[1] > 0 and w.is_contiguous())

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [..., K], w [N, K] contiguous -> [..., N] (float32, or int32 for int8)."""
        n, k = w.shape
        x2 = x.reshape(-1, k).contiguous()
        out = torch.empty(x2.shape[0], n, dtype=torch.float32 if x.dtype == torch.float32
                          else torch.int32)
        fn = self._f32 if x.dtype == torch.float32 else self._s8
        if fn(out.data_ptr(), x2.data_ptr(), w.data_ptr(), x2.shape[0], n, k):
            raise ValueError(f"gemv: unsupported shapes x {tuple(x.shape)}, w {tuple(w.shape)}")
        return out.view(*x.shape[:-1], n)


def gemv() -> Gemv | None:
    """The skinny-GEMM kernel, or None (logged) where it cannot be built."""
    lib = load_library("qwenserve_gemv", [os.path.join(CSRC, "gemv.cpp")],
                       cflags=(*DEFAULT_CFLAGS, *FAST_MATH))
    return None if lib is None else Gemv(lib)
