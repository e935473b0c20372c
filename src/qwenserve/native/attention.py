"""Typed Python faces of the attention kernels (paged decode, bf16 prefill)."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from qwenserve.logger import init_logger
from qwenserve.native.build import CSRC, DEFAULT_CFLAGS, FAST_MATH, load_library
from qwenserve.native.build import F32 as _F
from qwenserve.native.build import I64 as _I
from qwenserve.native.build import PTR as _P

logger = init_logger(__name__)


class DecodeAttention:
    """``csrc/decode_attention.cpp``: paged decode attention reading the cache in place, and
    (optionally) writing the step's new K and V into their slots first."""

    DTYPES = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {}
        for dtype, name in self.DTYPES.items():
            fn = getattr(lib, name)
            fn.argtypes = ([_P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F]
                           + [_P, _P, _I, _I, _P])
            fn.restype = ctypes.c_int
            self._fns[dtype] = fn
        self._use_amx = lib.paged_decode_use_amx
        self._use_amx.argtypes = [ctypes.c_int, _I]
        self._use_amx.restype = ctypes.c_int
        self._use_wide_f32 = lib.paged_decode_use_avx512_f32
        self._use_wide_f32.argtypes = [ctypes.c_int]
        self._use_wide_f32.restype = ctypes.c_int

    def use_amx(self, on: bool, min_group: int = 0) -> bool:
        """Whether bf16 decodes take the AMX kernel (the default where it runs) or the
        vdpbf16ps one, and from how many query heads per KV head (``min_group`` > 0; default 2):
        a switch for tests and benchmarks, process-wide. Returns whether the AMX kernel can
        run here at all."""
        return bool(self._use_amx(int(on), min_group))

    def use_wide_f32(self, on: bool) -> bool:
        """Whether fp32 decodes take the 16-lane AVX512 kernel (the default where the build
        has AVX512) or the generic 8-lane one: a switch for tests and benchmarks, process-wide.
        Returns whether the 16-lane kernel is built here."""
        return bool(self._use_wide_f32(int(on)))

    def supports(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return (kv_cache.dtype == q.dtype and q.device.type == "cpu"
                and self.supports_cache(kv_cache))

    def supports_cache(self, kv_cache: torch.Tensor) -> bool:
        """Whether the kernel decodes from this cache (its queries in the cache's dtype)."""
        return (kv_cache.dtype in self._fns and kv_cache.device.type == "cpu"
                and kv_cache.is_contiguous() and kv_cache.shape[-1] % 8 == 0)

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, block_size: int, scale: float,
                 new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """q [n, Hq, D], kv_cache [2, num_slots, Hkv, D] (contiguous), block_tables
        [n, W] int64, ctx_lens [n] int64 -> [n, Hq, D]. ``new_kv`` = (k [n, Hkv, D], v, slots
        [n] int64): each sequence's new token, written into its slot before it is read."""
        q = heads_rows(q)
        tables, lens = block_tables.contiguous(), ctx_lens.contiguous()
        assert tables.dtype == lens.dtype == torch.int64 and tables.shape[0] == q.shape[0]
        n, hq, d = q.shape
        hkv = kv_cache.shape[2]
        fresh: list = [None, None, 0, 0, None]
        if new_kv is not None:
            k, v, slots = heads_rows(new_kv[0]), heads_rows(new_kv[1]), new_kv[2].contiguous()
            assert k.shape == v.shape == (n, hkv, d) and k.dtype == v.dtype == kv_cache.dtype
            assert slots.dtype == torch.int64 and slots.shape == (n,)
            fresh = [k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), slots.data_ptr()]
        out = torch.empty(n, hq, d, dtype=q.dtype)
        status = self._fns[q.dtype](out.data_ptr(), q.data_ptr(), q.stride(0),
                                    kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                                    tables.data_ptr(), tables.shape[1], lens.data_ptr(), n, hq,
                                    hkv, d, block_size, scale, *fresh)
        if status:
            raise ValueError(f"paged_decode: unsupported shape q {tuple(q.shape)}, "
                             f"kv_cache {tuple(kv_cache.shape)}")
        return out


def heads_rows(t: torch.Tensor) -> torch.Tensor:
    """t [n, H, D] with each row's heads contiguous (rows may be apart, as a slice of a fused
    projection's output is): t itself where it is laid out so, a contiguous copy otherwise."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def decode_attention() -> DecodeAttention | None:
    """The decode-attention kernel, or None (logged) where it cannot be built."""
    lib = load_library("qwenserve_decode_attention", [os.path.join(CSRC, "decode_attention.cpp")],
                       cflags=(*DEFAULT_CFLAGS, *FAST_MATH))
    return None if lib is None else DecodeAttention(lib)


class PrefillAttention:
    """``csrc/prefill_attention.cpp``: causal attention of one prefill chunk over its context
    (bf16; Q . K^T and P . V on AMX tiles, or as AVX512-BF16 dot products on CPUs without AMX;
    softmax in fp32)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.prefill_attention_bf16
        self._fn.argtypes = [_P, _I, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F]
        self._fn.restype = ctypes.c_int
        self._use_amx = lib.prefill_attention_use_amx
        self._use_amx.argtypes = [ctypes.c_int]
        self._use_amx.restype = ctypes.c_int
        self.available = bool(lib.prefill_attention_available())

    def use_amx(self, on: bool) -> bool:
        """Whether calls take the AMX tiles (the default where they run) or the vdpbf16ps dot
        products: a switch for tests and benchmarks, process-wide. Returns whether the AMX
        route can run here at all."""
        return bool(self._use_amx(int(on)))

    def supports(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> bool:
        return (self.available and scale > 0 and q.dtype == k.dtype == v.dtype == torch.bfloat16
                and q.device.type == "cpu" and q.dim() == k.dim() == v.dim() == 3
                and q.shape[2] % 32 == 0 and k.shape == v.shape and q.shape[2] == k.shape[2]
                and q.shape[1] % k.shape[1] == 0 and 0 < q.shape[0] <= k.shape[0])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """q [L, Hq, D], k/v [S, Hkv, D] -> [L, Hq, D]; query i at position S - L + i."""
        q, k, v = heads_rows(q), heads_rows(k), heads_rows(v)
        (length, hq, d), (ctx, hkv, _) = q.shape, k.shape
        out = torch.empty(length, hq, d, dtype=q.dtype)
        status = self._fn(out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0), k.data_ptr(),
                          k.stride(0), v.data_ptr(), v.stride(0), length, ctx, hq, hkv, d, scale)
        if status:
            raise ValueError(f"prefill_attention: unsupported shapes q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}")
        return out


def prefill_attention_library() -> ctypes.CDLL | None:
    """The compiled library (it builds on every x86 CPU; AVX512-BF16 ones run its kernel, on
    AMX tiles where the CPU has them)."""
    return load_library("qwenserve_prefill_attention",
                        [os.path.join(CSRC, "prefill_attention.cpp")],
                        cflags=(*DEFAULT_CFLAGS, *FAST_MATH))


@functools.cache
def prefill_attention() -> PrefillAttention | None:
    """The bf16 prefill-attention kernel, or None (logged once) where it cannot be built or the
    CPU has no AVX512-BF16."""
    lib = prefill_attention_library()
    if lib is None:
        return None
    kernel = PrefillAttention(lib)
    if not kernel.available:
        logger.info("prefill attention: no AVX512-BF16 in this build (CPU or compiler); bf16 "
                    "prefill chunks use PyTorch's flash kernel")
        return None
    return kernel
