"""Typed Python faces of the native kernels; each library is built on first use."""

from __future__ import annotations

import ctypes
import functools
import os
import platform

import torch

from qwenserve.logger import init_logger
from qwenserve.native.build import DEFAULT_CFLAGS, load_library

logger = init_logger(__name__)

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
        return (q.dtype in self._fns and kv_cache.dtype == q.dtype and q.device.type == "cpu"
                and kv_cache.is_contiguous() and q.shape[-1] % 8 == 0)

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
    """``csrc/prefill_attention.cpp``: causal attention of one prefill chunk over its context on
    AMX tiles (bf16; Q . K^T and P . V as tile products, softmax in fp32)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.prefill_attention_bf16
        self._fn.argtypes = [_P, _I, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F]
        self._fn.restype = ctypes.c_int
        self.available = bool(lib.prefill_attention_available())

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
    """The compiled library (it builds on every x86 CPU; only AMX ones can run its kernel)."""
    return load_library("qwenserve_prefill_attention",
                        [os.path.join(CSRC, "prefill_attention.cpp")],
                        cflags=(*DEFAULT_CFLAGS, *FAST_MATH))


@functools.cache
def prefill_attention() -> PrefillAttention | None:
    """The AMX prefill-attention kernel, or None (logged once) where it cannot be built or the
    CPU (or the process) cannot use AMX tiles."""
    lib = prefill_attention_library()
    if lib is None:
        return None
    kernel = PrefillAttention(lib)
    if not kernel.available:
        logger.info("prefill attention: no AMX tiles for this process (CPU, compiler or kernel "
                    "permission); prefill chunks use PyTorch's flash kernel")
        return None
    return kernel


class Gemv:
    """``csrc/gemv.cpp``: ``x @ w.T`` for a few rows of x (decode), streaming the [N, K] weight
    once; float32, bf16 (fp32 sums, where the build has AVX512-BF16) and int8 x int8 -> int32
    (exact, as ``torch._int_mm``)."""

    MAX_ROWS = 4  # decode rows; from 8 rows the blocked GEMMs win (benchmarks.md)

    def __init__(self, lib: ctypes.CDLL) -> None:
        # dtype of x and w -> (entry point, dtype of the result)
        self._entries = {torch.float32: (lib.gemv_f32, torch.float32),
                         torch.int8: (lib.gemv_s8s32, torch.int32)}
        for fn, _ in self._entries.values():
            fn.argtypes = [_P, _P, _P, _I, _I, _I]
            fn.restype = ctypes.c_int
        if lib.gemv_bf16_fast():  # its entry also takes the bias (added before the rounding)
            lib.gemv_bf16.argtypes = [_P, _P, _P, _P, _I, _I, _I]
            lib.gemv_bf16.restype = ctypes.c_int
            self._entries[torch.bfloat16] = (lib.gemv_bf16, torch.bfloat16)
        self._s8_scaled = lib.gemv_s8_scaled
        self._s8_scaled.argtypes = [_P] * 6 + [_I, _I, _I, ctypes.c_int]
        self._s8_scaled.restype = ctypes.c_int

    def supports(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether ``__call__`` takes this pair: CPU, same dtype, a contiguous [N, K] weight."""
        return (x.dtype == w.dtype and x.dtype in self._entries
                and x.device.type == "cpu" and w.device.type == "cpu" and w.dim() == 2
                and x.shape[-1] == w.shape[1] and x.numel() > 0 and w.shape[0] > 0
                and w.shape[1] > 0 and w.is_contiguous())

    def __call__(self, x: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K], w [N, K] contiguous, bias [N] or None -> [..., N] (float32, bf16, or
        int32 for int8; a bias with int8 is the caller's to add after its scaling)."""
        assert bias is None or x.dtype != torch.int8, "int8 sums are scaled before any bias"
        n, k = w.shape
        x2 = x.reshape(-1, k).contiguous()
        fn, out_dtype = self._entries[x.dtype]
        out = torch.empty(x2.shape[0], n, dtype=out_dtype)
        args = (out.data_ptr(), x2.data_ptr(), w.data_ptr())
        in_kernel = x.dtype == torch.bfloat16  # added in fp32 before the one rounding
        if in_kernel:
            b = None if bias is None else bias.to(torch.bfloat16).contiguous()
            status = fn(*args, None if b is None else b.data_ptr(), x2.shape[0], n, k)
        else:
            status = fn(*args, x2.shape[0], n, k)
        if status:
            raise ValueError(f"gemv: unsupported shapes x {tuple(x.shape)}, w {tuple(w.shape)}")
        out = out.view(*x.shape[:-1], n)
        return out if bias is None or in_kernel else out.add_(bias)

    SCALED_DTYPES = (torch.float32, torch.bfloat16)

    def int8_scaled(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                    token_scale: torch.Tensor | None, int_bias: torch.Tensor | None,
                    out_dtype: torch.dtype) -> torch.Tensor | None:
        """``int32_epilogue(self(a_q, w_q), scale, token_scale, int_bias, out_dtype)`` in the
        kernel, to the same values: a_q [M, K] int8, w_q [N, K] int8 (``supports``), scale [N],
        token_scale [M, 1] float32, int_bias [N] int32 -> [M, N]. None for an out_dtype or
        scales it does not take (the caller then scales the int32 sums itself)."""
        m, n = a_q.shape[0], w_q.shape[0]
        if (out_dtype not in self.SCALED_DTYPES or a_q.dim() != 2
                or scale.dtype != torch.float32 or scale.numel() != n
                or (token_scale is not None and (token_scale.dtype != torch.float32
                                                 or token_scale.numel() != m))
                or (int_bias is not None and (int_bias.dtype != torch.int32
                                              or int_bias.numel() != n))):
            return None
        a_q, scale = a_q.contiguous(), scale.contiguous()
        token_scale = None if token_scale is None else token_scale.contiguous()
        int_bias = None if int_bias is None else int_bias.contiguous()
        out = torch.empty(m, n, dtype=out_dtype)
        status = self._s8_scaled(out.data_ptr(), a_q.data_ptr(), w_q.data_ptr(),
                                 scale.data_ptr(),
                                 None if token_scale is None else token_scale.data_ptr(),
                                 None if int_bias is None else int_bias.data_ptr(), m, n,
                                 a_q.shape[1], int(out_dtype == torch.bfloat16))
        if status:
            raise ValueError(f"gemv: unsupported shapes x {tuple(a_q.shape)}, "
                             f"w {tuple(w_q.shape)}")
        return out


def gemv() -> Gemv | None:
    """The skinny-GEMM kernel, or None (logged) where it cannot be built."""
    lib = load_library("qwenserve_gemv", [os.path.join(CSRC, "gemv.cpp")],
                       cflags=(*DEFAULT_CFLAGS, *FAST_MATH))
    return None if lib is None else Gemv(lib)


class _RowMajorGemm:
    """``x @ w.T + bias`` through a native entry point ``(y, x, w, bias, M, N, K, ldx)`` that
    reads x's rows in place (row stride ldx) and the [N, K] weight where the model keeps it."""

    dtype: torch.dtype
    statuses: str  # what the entry point's non-zero statuses mean (for the error)

    def __init__(self, fn: ctypes._CFuncPtr) -> None:
        self._fn = fn
        self._fn.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I]
        self._fn.restype = ctypes.c_int

    def supports(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether ``__call__`` takes this pair: CPU tensors in ``dtype``, a contiguous [N, K]
        weight (x of any layout: its rows are copied when they are not contiguous)."""
        return (x.dtype == w.dtype == self.dtype and x.is_cpu and w.is_cpu and w.dim() == 2
                and x.shape[-1] == w.shape[1] and x.numel() > 0 and w.shape[0] > 0
                and w.is_contiguous())

    def __call__(self, x: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K], w [N, K] contiguous, bias [N] in ``dtype`` or None -> [..., N] in
        ``dtype``."""
        return self._run(self._fn, x, w, bias, w.shape[0])

    def _run(self, fn: ctypes._CFuncPtr, x: torch.Tensor, w: torch.Tensor,
             bias: torch.Tensor | None, width: int) -> torch.Tensor:
        """``fn(y, x, w, bias, M, width, K, ldx)`` into a new [..., width] y."""
        k = w.shape[1]
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1 or x2.stride(0) < k:
            x2 = x2.contiguous()
        if bias is not None:
            bias = bias.contiguous()
            assert bias.dtype == self.dtype and bias.numel() == w.shape[0]
        out = torch.empty(x2.shape[0], width, dtype=self.dtype)
        status = fn(out.data_ptr(), x2.data_ptr(), w.data_ptr(),
                    None if bias is None else bias.data_ptr(), x2.shape[0], width, k,
                    x2.stride(0))
        if status:
            raise ValueError(f"{fn.__name__}: status {status} for x {tuple(x.shape)}, "
                             f"w {tuple(w.shape)} ({self.statuses})")
        return out.view(*x.shape[:-1], width)


class Sgemm(_RowMajorGemm):
    """``csrc/sgemm.cpp``: ``x @ w.T + bias`` in float32 for any number of rows, cache-blocked
    (AVX2 + FMA; 16 lanes where the build has AVX512), reading the [N, K] weight in place and
    packing only x per call."""

    dtype = torch.float32
    statuses = "1: empty shape, 2: built without AVX2+FMA, 3: out of memory"


def sgemm() -> Sgemm | None:
    """The blocked fp32 GEMM, or None (logged) where it cannot be built or the CPU has no
    AVX2 + FMA (the kernel's only code path)."""
    lib = load_library("qwenserve_sgemm", [os.path.join(CSRC, "sgemm.cpp")])
    if lib is None:
        return None
    if not lib.sgemm_f32_available():
        logger.info("native sgemm not used: this CPU has no AVX2 + FMA; using the platform GEMM")
        return None
    return Sgemm(lib.sgemm_f32)


class Bgemm(_RowMajorGemm):
    """``csrc/bgemm.cpp``: ``x @ w.T + bias`` in bf16 on AMX tiles for decode-sized batches,
    reading the [N, K] weight in place (sums in fp32, one rounding to bf16)."""

    dtype = torch.bfloat16
    statuses = "1: a shape it does not take, 2: no AMX, 3: out of memory"

    def __init__(self, fn: ctypes._CFuncPtr, silu_mul_fn: ctypes._CFuncPtr) -> None:
        super().__init__(fn)
        self._silu_mul = silu_mul_fn
        self._silu_mul.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I]
        self._silu_mul.restype = ctypes.c_int

    def supports(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """As the base's, with N and K multiples of 32 (the kernel's tiles)."""
        return super().supports(x, w) and w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0

    def silu_mul(self, x: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """An MLP's ``silu_and_mul(x @ w.T + bias)`` in one kernel: x [..., K], w [2I, K] (gate
        rows, then up rows) contiguous, bias [2I] or None -> [..., I], bit for bit what the
        GEMM and elementwise.cpp's SiLU-and-mul give in turn. Takes the pairs ``supports``
        accepts (2I a multiple of 32)."""
        return self._run(self._silu_mul, x, w, bias, w.shape[0] // 2)


@functools.cache
def bgemm() -> Bgemm | None:
    """The AMX bf16 GEMM for small batches, or None (logged once) where it cannot be built or the
    CPU (or the process) cannot use AMX tiles."""
    # no contraction into fused multiply-adds: the SiLU epilogue equals elementwise.cpp's bits
    lib = load_library("qwenserve_bgemm", [os.path.join(CSRC, "bgemm.cpp")],
                       cflags=(*DEFAULT_CFLAGS, "-ffp-contract=off"))
    if lib is None:
        return None
    if not lib.bgemm_bf16_available():
        logger.info("bf16 AMX GEMM not used: no AMX tiles for this process (CPU, compiler or "
                    "kernel permission); small bf16 batches use the platform GEMM")
        return None
    return Bgemm(lib.bgemm_bf16, lib.bgemm_bf16_silu_mul)


class Elementwise:
    """``csrc/elementwise.cpp``: residual-add + RMSNorm, SiLU-and-mul, rotary, per-token int8
    quantization and the per-token rescale of an int8 GEMM, in one pass each. Inputs are fp32 or
    bf16 CPU tensors whose last dimension is contiguous; ``supports`` says which, and callers
    run the PyTorch reference for anything else."""

    DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm, self._act, self._rot, self._quant, self._scale = {}, {}, {}, {}, {}
        self._act_quant = {}
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


class Sampling:
    """``csrc/sampling.cpp``: one draw per row of fp32 or bf16 logits (greedy, or temperature,
    min_p, top_k and top_p with a caller-given uniform per row), reading the logits in place
    (bf16 rows are widened, exactly, in cache: the same draws as for ``logits.float()``)."""

    DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the entry points' suffixes

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns, self._logprob_fns = {}, {}
        for dtype, tag in self.DTYPES.items():
            fn = getattr(lib, f"sample_rows_{tag}")
            fn.argtypes = [_P, _P, _I, _I, _I, _P, _P, _P, _P, _P]
            fn.restype = ctypes.c_int
            self._fns[dtype] = fn
            fn = getattr(lib, f"logprob_rows_{tag}")
            fn.argtypes = [_P, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P]
            fn.restype = ctypes.c_int
            self._logprob_fns[dtype] = fn

    def supports(self, logits: torch.Tensor) -> bool:
        return (logits.is_cpu and logits.dtype in self._fns and logits.dim() == 2
                and logits.stride(1) == 1 and logits.shape[1] > 0)

    def logprobs(self, logits: torch.Tensor, row_index: list[int], token_ids: list[int],
                 num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``row_index`` of logits [B, V] (``supports``): each row's token's logprob and
        rank, and its ``num_top`` best (logprobs, ids) ([n], [n], [n, k], [n, k]); ids past the
        vocabulary are refused."""
        n = len(row_index)
        rows = torch.tensor(row_index, dtype=torch.int64)
        chosen = torch.tensor(token_ids, dtype=torch.int64)
        chosen_lp, rank = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.int64)
        top_lp = torch.empty(n, num_top, dtype=torch.float32)
        top_id = torch.empty(n, num_top, dtype=torch.int64)
        if self._logprob_fns[logits.dtype](
                logits.data_ptr(), n, logits.shape[1], logits.stride(0), rows.data_ptr(),
                chosen.data_ptr(), num_top, chosen_lp.data_ptr(), rank.data_ptr(),
                top_lp.data_ptr(), top_id.data_ptr()):
            raise ValueError(f"logprob_rows: bad arguments for logits {tuple(logits.shape)} "
                             f"(token ids {token_ids}, {num_top} top)")
        return chosen_lp, rank, top_lp, top_id

    def draw(self, logits: torch.Tensor, temperature: list[float], top_k: list[int],
             top_p: list[float], min_p: list[float], uniform: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> token ids [B] int64. Per row: temperature (0: greedy), top_k (0:
        off), top_p (1: off), min_p (0: off); ``uniform`` [B] float64 in [0, 1)."""
        rows = logits.shape[0]
        assert len(temperature) == len(top_k) == len(top_p) == len(min_p) == rows
        assert uniform.dtype == torch.float64 and uniform.shape == (rows,)
        temps = torch.tensor(temperature, dtype=torch.float32)
        ks = torch.tensor(top_k, dtype=torch.int64)
        ps = torch.tensor(top_p, dtype=torch.float32)
        mins = torch.tensor(min_p, dtype=torch.float32)
        u = uniform.contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        if self._fns[logits.dtype](out.data_ptr(), logits.data_ptr(), rows, logits.shape[1],
                                   logits.stride(0), temps.data_ptr(), ks.data_ptr(),
                                   ps.data_ptr(), mins.data_ptr(), u.data_ptr()):
            raise ValueError(f"sample_rows: unsupported logits of shape {tuple(logits.shape)}")
        return out


def sampling() -> Sampling | None:
    """The sampling kernel, or None (logged) where it cannot be built."""
    lib = load_library("qwenserve_sampling", [os.path.join(CSRC, "sampling.cpp")],
                       cflags=(*DEFAULT_CFLAGS, *FAST_MATH))
    return None if lib is None else Sampling(lib)
