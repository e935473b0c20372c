"""Typed Python faces of the GEMM kernels: the streaming GEMV, the blocked fp32 GEMM, the
AMX bf16 and int8 GEMMs for decode-sized batches, and the packed bf16 and int8 GEMMs of
AVX512-BF16 / AVX512-VNNI CPUs without AMX."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from qwenserve.logger import init_logger
from qwenserve.native.build import CSRC, DEFAULT_CFLAGS, FAST_MATH, load_library
from qwenserve.native.build import I64 as _I
from qwenserve.native.build import PTR as _P

logger = init_logger(__name__)

# what W8A8's scaled entry points take besides x and w: (scale, token_scale, int_bias, bias)
# as contiguous tensors (None: absent), or None where one does not match the call
_Epilogue = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _w8a8_epilogue(m: int, n: int, scale: torch.Tensor, token_scale: torch.Tensor | None,
                   int_bias: torch.Tensor | None, bias: torch.Tensor | None,
                   out_dtype: torch.dtype) -> _Epilogue | None:
    """The scaling operands of an [m, n] W8A8 GEMM (``int32_epilogue``'s, plus a layer's float
    bias in out_dtype), checked and made contiguous for a native epilogue; None for what the
    kernels do not take (the caller then scales the int32 sums itself)."""
    if (out_dtype not in (torch.float32, torch.bfloat16)
            or scale.dtype != torch.float32 or scale.numel() != n
            or (token_scale is not None and (token_scale.dtype != torch.float32
                                             or token_scale.numel() != m))
            or (int_bias is not None and (int_bias.dtype != torch.int32
                                          or int_bias.numel() != n))
            or (bias is not None and (bias.dtype != out_dtype or bias.numel() != n))):
        return None
    return (scale.contiguous(), None if token_scale is None else token_scale.contiguous(),
            None if int_bias is None else int_bias.contiguous(),
            None if bias is None else bias.contiguous())


def _pointers(tensors: _Epilogue) -> list[int | None]:
    return [None if t is None else t.data_ptr() for t in tensors]


class Gemv:
    """``csrc/gemv.cpp``: ``x @ w.T`` for a few rows of x (decode), streaming the [N, K] weight
    once; float32, bf16 (fp32 sums, where the build has AVX512-BF16) and int8 x int8 -> int32
    (exact, as ``torch._int_mm``)."""

    MAX_ROWS = 4  # decode rows; from 8 rows the blocked GEMMs win (benchmarks.md)

    def __init__(self, lib: ctypes.CDLL) -> None:
        # dtype of x and w -> (entry point, dtype of the result); the float entries also take
        # the bias (added in fp32 before the rounding), int8's is the caller's (after scaling)
        self._entries = {torch.float32: (lib.gemv_f32, torch.float32),
                         torch.int8: (lib.gemv_s8s32, torch.int32)}
        lib.gemv_s8s32.argtypes = [_P, _P, _P, _I, _I, _I]
        floats = [lib.gemv_f32]
        if lib.gemv_bf16_fast():
            self._entries[torch.bfloat16] = (lib.gemv_bf16, torch.bfloat16)
            floats.append(lib.gemv_bf16)
        for fn in floats:
            fn.argtypes = [_P, _P, _P, _P, _I, _I, _I]
        for fn, _ in self._entries.values():
            fn.restype = ctypes.c_int
        self._s8_scaled = lib.gemv_s8_scaled
        self._s8_scaled.argtypes = [_P] * 7 + [_I, _I, _I, ctypes.c_int]
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
        if x.dtype == torch.int8:
            status = fn(*args, x2.shape[0], n, k)
        else:
            b = None if bias is None else bias.to(x.dtype).contiguous()
            status = fn(*args, None if b is None else b.data_ptr(), x2.shape[0], n, k)
        if status:
            raise ValueError(f"gemv: unsupported shapes x {tuple(x.shape)}, w {tuple(w.shape)}")
        return out.view(*x.shape[:-1], n)

    def int8_scaled(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                    token_scale: torch.Tensor | None, int_bias: torch.Tensor | None,
                    out_dtype: torch.dtype, bias: torch.Tensor | None = None
                    ) -> torch.Tensor | None:
        """``int32_epilogue(self(a_q, w_q), scale, token_scale, int_bias, out_dtype) + bias``
        in the kernel, to the same values: a_q [M, K] int8, w_q [N, K] int8 (``supports``),
        scale [N], token_scale [M, 1] float32, int_bias [N] int32, bias [N] in out_dtype (a
        layer's float bias) -> [M, N]. None for an out_dtype or scales it does not take (the
        caller then scales the int32 sums itself)."""
        m, n = a_q.shape[0], w_q.shape[0]
        epilogue = _w8a8_epilogue(m, n, scale, token_scale, int_bias, bias, out_dtype)
        if a_q.dim() != 2 or epilogue is None:
            return None
        a_q = a_q.contiguous()
        out = torch.empty(m, n, dtype=out_dtype)
        status = self._s8_scaled(out.data_ptr(), a_q.data_ptr(), w_q.data_ptr(),
                                 *_pointers(epilogue), m, n, a_q.shape[1],
                                 int(out_dtype == torch.bfloat16))
        if status:
            raise ValueError(f"gemv: unsupported shapes x {tuple(a_q.shape)}, "
                             f"w {tuple(w_q.shape)}")
        return out

def gemv() -> Gemv | None:
    """The skinny-GEMM kernel, or None (logged) where it cannot be built."""
    lib = load_library("qwenserve_gemv", [os.path.join(CSRC, "gemv.cpp")],
                       cflags=(*DEFAULT_CFLAGS, *FAST_MATH))
    return None if lib is None else Gemv(lib)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., K] as [M, K] rows a kernel reads in place (rows any stride apart, values
    contiguous), copied only where its layout does not allow that."""
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or x2.stride(0) < k:
        x2 = x2.contiguous()
    return x2


def _row_major_entry(fn: ctypes._CFuncPtr) -> ctypes._CFuncPtr:
    """fn with the signature of a row-major GEMM entry point: (y, x, w, bias, M, N, K, ldx) ->
    status."""
    fn.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I]
    fn.restype = ctypes.c_int
    return fn


class _RowMajorGemm:
    """``x @ w.T + bias`` through a native entry point ``(y, x, w, bias, M, N, K, ldx)`` that
    reads x's rows in place (row stride ldx) and the [N, K] weight where the model keeps it."""

    dtype: torch.dtype
    statuses: str  # what the entry point's non-zero statuses mean (for the error)

    def __init__(self, fn: ctypes._CFuncPtr) -> None:
        self._fn = _row_major_entry(fn)

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
        out = torch.empty(x.numel() // w.shape[1], width, dtype=self.dtype)
        self._launch(fn, out, x, w, bias, width)
        return out.view(*x.shape[:-1], width)

    def _launch(self, fn: ctypes._CFuncPtr, out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                bias: torch.Tensor | None, width: int) -> None:
        """``fn(out, x, w, bias, M, width, K, ldx)``, x's rows in place where their layout lets
        the kernel read them; a non-zero status raises."""
        k = w.shape[1]
        x2 = _rows(x, k)
        if bias is not None:
            bias = bias.contiguous()
            assert bias.dtype == self.dtype and bias.numel() == w.shape[0]
        status = fn(out.data_ptr(), x2.data_ptr(), w.data_ptr(),
                    None if bias is None else bias.data_ptr(), x2.shape[0], width, k,
                    x2.stride(0))
        if status:
            raise ValueError(f"{fn.__name__}: status {status} for x {tuple(x.shape)}, "
                             f"w {tuple(w.shape)} ({self.statuses})")


class Sgemm(_RowMajorGemm):
    """``csrc/sgemm.cpp``: ``x @ w.T + bias`` in float32 for any number of rows, cache-blocked
    (AVX2 + FMA; 16 lanes where the build has AVX512), reading the [N, K] weight in place and
    packing only x per call."""

    dtype = torch.float32
    statuses = "1: empty shape, 2: built without AVX2+FMA, 3: out of memory"


def sgemm() -> Sgemm | None:
    """The blocked fp32 GEMM, or None (logged) where it cannot be built or the CPU has no
    AVX2 + FMA (the kernel's only code path)."""
    lib = _probed_library("sgemm", "sgemm_f32_available",
                          "native sgemm not used: this CPU has no AVX2 + FMA; using the platform "
                          "GEMM")
    return None if lib is None else Sgemm(lib.sgemm_f32)


class Bgemm(_RowMajorGemm):
    """``csrc/bgemm.cpp``: ``x @ w.T + bias`` in bf16 on AMX tiles for decode-sized batches,
    reading the [N, K] weight in place (sums in fp32, one rounding to bf16)."""

    dtype = torch.bfloat16
    statuses = "1: a shape it does not take, 2: no AMX, 3: out of memory"

    def __init__(self, fn: ctypes._CFuncPtr, silu_mul_fn: ctypes._CFuncPtr,
                 argmax_fn: ctypes._CFuncPtr) -> None:
        super().__init__(fn)
        self._silu_mul = _row_major_entry(silu_mul_fn)
        self._argmax = _row_major_entry(argmax_fn)

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

    def argmax(self, x: torch.Tensor, w: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """A greedy LM head in one kernel: x [n, K], w [V, K] contiguous, bias [V] or None ->
        [n] int64, ``(x @ w.T + bias).argmax(-1)`` of this GEMM's bf16 logits (the first of
        equal maxima, NaN passed over) without the [n, V] logits. Takes the pairs ``supports``
        accepts."""
        tokens = torch.empty(x.numel() // w.shape[1], dtype=torch.int64)
        self._launch(self._argmax, tokens, x, w, bias, w.shape[0])
        return tokens.view(x.shape[:-1])


def _probed_library(name: str, available: str, not_used: str,
                    cflags: tuple[str, ...] = DEFAULT_CFLAGS) -> ctypes.CDLL | None:
    """``csrc/<name>.cpp``'s library, or None where it cannot be built or ``available`` (its
    probe) says 0, the CPU or the process cannot run it: ``not_used`` logged once."""
    lib = load_library(f"qwenserve_{name}", [os.path.join(CSRC, f"{name}.cpp")], cflags=cflags)
    if lib is None:
        return None
    if not getattr(lib, available)():
        logger.info(not_used)
        return None
    return lib


def _amx_library(name: str, available: str, not_used: str) -> ctypes.CDLL | None:
    """``_probed_library`` of an AMX kernel (its probe: whether the CPU or the process can use
    the tiles)."""
    # no contraction into fused multiply-adds: the epilogues equal the unfused paths' bits
    return _probed_library(name, available, not_used, (*DEFAULT_CFLAGS, "-ffp-contract=off"))


@functools.cache
def bgemm() -> Bgemm | None:
    """The AMX bf16 GEMM for small batches, or None (logged once) where it cannot be built or the
    CPU (or the process) cannot use AMX tiles."""
    lib = _amx_library("bgemm", "bgemm_bf16_available",
                       "bf16 AMX GEMM not used: no AMX tiles for this process (CPU, compiler or "
                       "kernel permission); small bf16 batches use the platform GEMM")
    return None if lib is None else Bgemm(lib.bgemm_bf16, lib.bgemm_bf16_silu_mul,
                                          lib.bgemm_bf16_argmax)


class Igemm:
    """``csrc/igemm.cpp``: W8A8's GEMM with its scaling on AMX-INT8 tiles for decode-sized
    batches, reading the [N, K] int8 weight in place: ``int32_epilogue``'s values (and a layer's
    float bias after them), as ``Gemv.int8_scaled`` gives for a row or two."""

    def __init__(self, fn: ctypes._CFuncPtr) -> None:
        self._fn = fn
        self._fn.argtypes = [_P] * 7 + [_I] * 4 + [ctypes.c_int]
        self._fn.restype = ctypes.c_int

    def scaled(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
               token_scale: torch.Tensor | None, int_bias: torch.Tensor | None,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """a_q [M, K] int8, w_q [N, K] int8 contiguous, scale [N] float32, token_scale [M, 1]
        float32, int_bias [N] int32, bias [N] in out_dtype -> [M, N] in out_dtype; None for
        what it does not take (K not a multiple of 64, N of 32, other dtypes)."""
        m, (n, k) = a_q.shape[0], w_q.shape
        if (a_q.dim() != 2 or a_q.dtype != torch.int8 or w_q.dtype != torch.int8
                or not w_q.is_contiguous() or a_q.shape[1] != k or k % 64 or n % 32
                or a_q.stride(1) != 1):
            return None
        epilogue = _w8a8_epilogue(m, n, scale, token_scale, int_bias, bias, out_dtype)
        if epilogue is None:
            return None
        out = torch.empty(m, n, dtype=out_dtype)
        status = self._fn(out.data_ptr(), a_q.data_ptr(), w_q.data_ptr(), *_pointers(epilogue),
                          m, n, k, a_q.stride(0), int(out_dtype == torch.bfloat16))
        if status:
            raise ValueError(f"igemm_s8_scaled: status {status} for x {tuple(a_q.shape)}, "
                             f"w {tuple(w_q.shape)} (2: no AMX-INT8, 3: out of memory)")
        return out


@functools.cache
def igemm() -> Igemm | None:
    """The AMX-INT8 W8A8 GEMM for small batches, or None (logged once) where it cannot be built
    or the CPU (or the process) cannot use AMX-INT8 tiles."""
    lib = _amx_library("igemm", "igemm_s8_available",
                       "int8 AMX GEMM not used: no AMX-INT8 tiles for this process (CPU, compiler "
                       "or kernel permission); small W8A8 batches use the platform GEMM")
    return None if lib is None else Igemm(lib.igemm_s8_scaled)


def _packed_copy(pack: ctypes._CFuncPtr, w: torch.Tensor, size: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """``pack(dst, w, N, K)``'s copy of the [N, K] weight w, into a new flat tensor of ``size``
    elements of ``dtype`` (the packed GEMMs' layouts)."""
    n, k = w.shape
    w = w.contiguous()
    out = torch.empty(size, dtype=dtype)
    pack(out.data_ptr(), w.data_ptr(), n, k)
    return out


class Pbgemm:
    """``csrc/pbgemm.cpp``: bf16 ``x @ w.T + bias`` with AVX512-BF16 dot products on a copy of w
    packed once into 64-column panels of k-pairs (``pack``), fp32 sums and one rounding, for
    CPUs without AMX (where it ran 1.1-1.25x oneDNN's packed bf16 kernel at decode sizes); an
    MLP's gate_up GEMM with its SiLU-and-mul in the epilogue (``silu_mul``); a greedy LM head
    with the argmax in it (``argmax``)."""

    dtype = torch.bfloat16

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._size = lib.pbgemm_packed_size
        self._size.argtypes = [_I, _I]
        self._size.restype = ctypes.c_int64
        self._pack = lib.pbgemm_pack
        self._pack.argtypes = [_P, _P, _I, _I]
        self._pack.restype = None
        self._fn = lib.pbgemm_bf16
        self._silu_mul = lib.pbgemm_bf16_silu_mul
        self._argmax = lib.pbgemm_bf16_argmax
        for fn in (self._fn, self._silu_mul, self._argmax):
            fn.argtypes = [_P, _P, _I, _P, _P, ctypes.c_int, _I, _I, _I]
            fn.restype = ctypes.c_int

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        """The packed copy of a bf16 [N, K] weight (a flat bf16 tensor)."""
        return _packed_copy(self._pack, w, self._size(*w.shape), torch.bfloat16)

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] bf16, ``pack``'s copy of an [n, K] weight, bias [n] (bf16 or float32) or
        None -> [..., n] bf16 (the bias added to the fp32 sums before the one rounding; the
        kernel widens a bf16 one, so a replayed step has no conversion op before the call)."""
        return self._run(self._fn, x, packed, n, n, bias)

    @staticmethod
    def silu_mul_takes(n: int) -> bool:
        """Whether ``silu_mul`` takes a merged gate_up weight of n = 2I rows: I a multiple of
        64, so that no panel holds both gate and up columns."""
        return n % 128 == 0

    def silu_mul(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """An MLP's ``silu_and_mul(x @ w.T + bias)`` in one kernel: x [..., K], ``pack``'s copy
        of the merged w [n = 2I, K] (gate rows, then up rows; ``silu_mul_takes(n)``), bias [2I]
        or None -> [..., I], bit for bit the GEMM followed by elementwise's SiLU-and-mul."""
        assert self.silu_mul_takes(n), f"gate_up of {n} rows: I is not a multiple of 64"
        return self._run(self._silu_mul, x, packed, n, n // 2, bias)

    def argmax(self, x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """A greedy LM head in one kernel: x [..., K], ``pack``'s copy of w [n = V, K], bias [V]
        or None -> [...] int64, ``(x @ w.T + bias).argmax(-1)`` of this GEMM's bf16 logits (the
        first of equal maxima, NaN passed over, as ``Bgemm.argmax``) without the logits."""
        return self._run(self._argmax, x, packed, n, 0, bias)

    def _run(self, fn: ctypes._CFuncPtr, x: torch.Tensor, packed: torch.Tensor, n: int,
             width: int, bias: torch.Tensor | None) -> torch.Tensor:
        """``fn(y, x, ldx, packed, bias, bias_bf16, M, N, K)`` into a new [..., width] bf16 y, for
        a weight of n rows packed; width 0: ``fn`` writes one int64 token a row (N = n)."""
        k = x.shape[-1]
        x2 = _rows(x, k)
        # pbgemm_packed_size's sum, not its call (a replayed step would repeat the call)
        assert packed.numel() == -(-n // 64) * 64 * (k + k % 2), "packed for another shape"
        b = None if bias is None else bias.contiguous()
        if b is not None:
            assert b.numel() == n, f"bias of {b.numel()} for {n} columns"
            b = b if b.dtype in (torch.bfloat16, torch.float32) else b.float()
        out = (torch.empty(x2.shape[0], width, dtype=torch.bfloat16) if width
               else torch.empty(x2.shape[0], dtype=torch.int64))
        if out.numel() == 0:  # no rows (an empty chunk): F.linear's empty result
            return out.view(*x.shape[:-1], width) if width else out.view(x.shape[:-1])
        status = fn(out.data_ptr(), x2.data_ptr(), x2.stride(0), packed.data_ptr(),
                    None if b is None else b.data_ptr(),
                    int(b is not None and b.dtype == torch.bfloat16), x2.shape[0], width or n, k)
        if status:
            raise ValueError(f"{fn.__name__}: unsupported shapes x {tuple(x.shape)}, n {n}")
        return out.view(*x.shape[:-1], width) if width else out.view(x.shape[:-1])


@functools.cache
def pbgemm() -> Pbgemm | None:
    """The packed bf16 GEMM, or None (logged once) where it cannot be built or the build has no
    AVX512-BF16."""
    lib = _probed_library("pbgemm", "pbgemm_available",
                          "packed bf16 GEMM not used: no AVX512-BF16 in this build (CPU or "
                          "compiler)")
    return None if lib is None else Pbgemm(lib)


class Pigemm:
    """``csrc/pigemm.cpp``: W8A8's GEMM with its scaling, with AVX512-VNNI dot products on a copy
    of the int8 weight packed once into 64-column panels of k-quads (``pack``), for CPUs without
    AMX-INT8: ``int32_epilogue``'s values (and a layer's float bias after them), as
    ``Igemm.scaled`` gives, at any number of rows."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._pack = lib.pigemm_pack
        self._pack.argtypes = [_P, _P, _I, _I]
        self._pack.restype = None
        self._fn = lib.pigemm_s8_scaled
        self._fn.argtypes = [_P, _P, _I] + [_P] * 5 + [ctypes.c_int, _I, _I, _I]
        self._fn.restype = ctypes.c_int
        self._silu_mul = lib.pigemm_s8_silu_mul
        self._silu_mul.argtypes = [_P, _P, _I] + [_P] * 4 + [ctypes.c_int, _I, _I, _I]
        self._silu_mul.restype = ctypes.c_int

    @staticmethod
    def packed_size(n: int, k: int) -> int:
        """Bytes of an [n, k] weight's packed copy (``pigemm_packed_size``'s sum: 64-column
        panels of k-quads, then 64 int32 corrections a panel)."""
        return -(-n // 64) * (-(-k // 4) * 256 + 256)

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        """The packed copy of an int8 [N, K] weight (a flat int8 tensor)."""
        return _packed_copy(self._pack, w, self.packed_size(*w.shape), torch.int8)

    def scaled(self, a_q: torch.Tensor, packed: torch.Tensor, n: int, scale: torch.Tensor,
               token_scale: torch.Tensor | None, int_bias: torch.Tensor | None,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """a_q [M, K] int8 (rows read in place where their layout allows), ``pack``'s copy of
        an int8 [n, K] weight, scale [n] float32, token_scale [M, 1] float32, int_bias [n]
        int32, bias [n] in out_dtype -> [M, n] in out_dtype; None for what it does not take
        (other dtypes, K of 2^16 or more)."""
        operands = self._operands(a_q, packed, n, scale, token_scale, int_bias, bias, out_dtype)
        if operands is None:
            return None
        x, (s, ts, ib, b) = operands
        (m, k), out = x.shape, torch.empty(x.shape[0], n, dtype=out_dtype)
        status = self._fn(out.data_ptr(), x.data_ptr(), x.stride(0), packed.data_ptr(), s, ts,
                          ib, b, int(out_dtype == torch.bfloat16), m, n, k)
        if status:
            raise ValueError(f"pigemm_s8_scaled: status {status} for x {tuple(x.shape)}, n {n}")
        return out

    def silu_mul(self, a_q: torch.Tensor, packed: torch.Tensor, n: int, scale: torch.Tensor,
                 token_scale: torch.Tensor | None, out_dtype: torch.dtype
                 ) -> torch.Tensor | None:
        """A W8A8 MLP's ``silu_and_mul`` of its gate_up GEMM in one kernel: a_q [M, K] int8,
        ``pack``'s copy of the merged [n = 2I, K] weight (gate rows, then up rows), scale [n],
        token_scale [M, 1] -> [M, I] in out_dtype, bit for bit ``scaled`` followed by
        elementwise's SiLU-and-mul. None for what it does not take (I not a multiple of 64,
        bf16 in a build without AVX512-BF16, other dtypes or shapes)."""
        operands = (self._operands(a_q, packed, n, scale, token_scale, None, None, out_dtype)
                    if n % 128 == 0 else None)
        if operands is None:
            return None
        x, (s, ts, _, _) = operands
        (m, k), out = x.shape, torch.empty(x.shape[0], n // 2, dtype=out_dtype)
        status = self._silu_mul(out.data_ptr(), x.data_ptr(), x.stride(0), packed.data_ptr(), s,
                                ts, None, int(out_dtype == torch.bfloat16), m, n // 2, k)
        return None if status else out

    def _operands(self, a_q: torch.Tensor, packed: torch.Tensor, n: int, scale: torch.Tensor,
                  token_scale: torch.Tensor | None, int_bias: torch.Tensor | None,
                  bias: torch.Tensor | None, out_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, list[int | None]] | None:
        """x's rows as the kernels read them and the scaling's pointers (``_w8a8_epilogue``),
        or None for a call they do not take: not [M > 0, K] int8, K of 2^16 or more (int32
        sums could overflow), a copy packed for another shape."""
        if a_q.dim() != 2 or a_q.dtype != torch.int8 or a_q.shape[0] == 0:
            return None
        m, k = a_q.shape
        if k >= 1 << 16 or packed.numel() != self.packed_size(n, k):
            return None
        epilogue = _w8a8_epilogue(m, n, scale, token_scale, int_bias, bias, out_dtype)
        return None if epilogue is None else (_rows(a_q, k), _pointers(epilogue))


@functools.cache
def pigemm() -> Pigemm | None:
    """The packed int8 GEMM, or None (logged once) where it cannot be built or the build has no
    AVX512-VNNI."""
    lib = _probed_library("pigemm", "pigemm_available",
                          "packed int8 GEMM not used: no AVX512-VNNI in this build (CPU or "
                          "compiler)", (*DEFAULT_CFLAGS, "-ffp-contract=off"))
    return None if lib is None else Pigemm(lib)
