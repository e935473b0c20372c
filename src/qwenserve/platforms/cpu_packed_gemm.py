"""GEMMs on weights packed once into oneDNN's blocked layout: bf16 on AMX / AVX512-BF16 CPUs,
float32 on AVX512 CPUs, int8 (W8A8) on AMX-INT8 / VNNI CPUs (``PackedFloatLinear`` also serves a
native kernel's own packing: ``layers/native_gemm.with_packed_bf16_gemm``).

torch's ``F.linear`` (bf16), oneDNN's linear on a plain weight (float32) and ``torch._int_mm``
(int8) hand oneDNN the plain [N, K] weight, and oneDNN reorders it into the blocked layout its
AMX / AVX512 / VNNI kernel reads, on every call: at decode sizes the reorder costs as much as the
product (docs/benchmarks.md, "bf16 on AMX", "float32 on packed weights" and "INT8 on AMX").
vLLM's CPU backend prepacks its weights for the same reason. Here each weight is packed at
its first call (which the worker makes at load: ``worker/warm_up.py``) and the packed copy kept
beside it, keyed weakly by the weight tensor (it goes when the weight goes) and made again if the
weight is written in place. The plain weight stays the
model's: weight accounting, tied embeddings and sharded-state saving see it unchanged; the price
is a second copy of those weights in host memory (logged once per kind;
``QWENSERVE_PACKED_BF16=0`` / ``QWENSERVE_PACKED_FP32=0`` / ``QWENSERVE_PACKED_INT8=0`` turn
packing off). Views (one expert's
slice of a stacked MoE weight) are a new tensor each call and are left to the plain kernels.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

# The batch size oneDNN is told to expect when it chooses the blocked layout; one layout serves
# every batch (1-2,048 rows measured within a few % of a per-size layout).
_PACK_BATCH_HINT = 64


def _pack_float(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack_int8(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_prepack(weight, None)


@functools.lru_cache(maxsize=64)
def _zero_points(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64)  # symmetric weights: one zero point per channel


def _packed_int8_mm(a_q: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None, a_scale: float = 1.0,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(a_q @ w_q.T) * (a_scale * scale) + bias`` in out_dtype: oneDNN sums in int32 and
    scales per tensor (a_scale) and per channel (scale)."""
    zero_points = _zero_points(scale.shape[0])
    return torch.ops.onednn.qlinear_pointwise(a_q, a_scale, 0, packed, scale, zero_points, bias,
                                              1.0, 0, out_dtype, "none", [], "")


def _is_packable(weight: torch.Tensor) -> bool:
    """A 2-D CPU tensor of its own (not a view, which is a new tensor every call), contiguous."""
    return (weight.dim() == 2 and weight.is_cpu and weight.is_contiguous()
            and weight._base is None and not weight.requires_grad)


class PackedWeights:
    """Each weight's packed copy, made at its first use and again after an in-place write."""

    def __init__(self, pack: Callable[[torch.Tensor], torch.Tensor],
                 announce: str | None = None) -> None:
        self._pack = pack
        self._announce = announce  # logged when the first weight is packed (None: nothing)
        # id(weight) -> (the weight's version when packed, the packed copy); an entry goes
        # when its weight is freed (tensors compare elementwise, so no WeakKeyDictionary)
        self._packed: dict[int, tuple[int, torch.Tensor]] = {}
        self.packed_bytes = 0  # of the weights packed so far

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        """The blocked copy of ``weight``, made now if it has none or was written since."""
        key = id(weight)
        entry = self._packed.get(key)
        if entry is not None and entry[0] == weight._version:
            return entry[1]
        packed = self._pack(weight)
        if entry is None:
            weakref.finalize(weight, self._forget, key, weight.numel() * weight.element_size())
            if not self.packed_bytes and self._announce is not None:
                logger.info(self._announce)
            self.packed_bytes += weight.numel() * weight.element_size()
        self._packed[key] = (weight._version, packed)
        return packed

    def _forget(self, key: int, nbytes: int) -> None:
        if self._packed.pop(key, None) is not None:
            self.packed_bytes -= nbytes


# What each packed float dtype's first packing logs: the memory it costs and its switch.
_FLOAT_ANNOUNCE = {
    torch.bfloat16: "bf16 GEMMs read each weight packed once for oneDNN's AMX/AVX512-BF16 "
                    "kernels: a second copy of the bf16 weights in host memory "
                    "(QWENSERVE_PACKED_BF16=0 turns this off)",
    torch.float32: "float32 GEMMs of 5 rows or more read each weight packed once for oneDNN's "
                   "AVX512 kernels: a second copy of the float32 weights in host memory "
                   "(QWENSERVE_PACKED_FP32=0 turns this off)",
}


# (x, the packed copy, the plain weight (for its shape), bias) -> x @ weight.T + bias
PackedRun = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"],
                     torch.Tensor]


def _onednn_run(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    return _packed_linear(x, packed, bias)


class PackedFloatLinear:
    """``linear(x, weight, bias)`` for weights of one float dtype (bf16 or float32) through a
    once-packed copy of each: oneDNN's blocked layout by default, or another kernel's ``pack``
    and ``run``."""

    def __init__(self, dtype: torch.dtype, pack: Callable[[torch.Tensor], torch.Tensor] = _pack_float,
                 run: PackedRun = _onednn_run, announce: str | None = None) -> None:
        self.dtype = dtype
        self._run = run
        self.packed = PackedWeights(pack, announce or _FLOAT_ANNOUNCE[dtype])

    def supports(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return weight.dtype == x.dtype == self.dtype and x.is_cpu and _is_packable(weight)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(x, self.packed(weight), weight, bias)


class PackedInt8Matmul:
    """The W8A8 GEMM ``(a_q @ w_q.T + int_bias) * scale * token_scale`` through a once-packed
    copy of each int8 weight (the ``Platform.int8_scaled_mm`` contract)."""

    def __init__(self) -> None:
        self.packed = PackedWeights(
            _pack_int8, "int8 GEMMs read each weight packed once for oneDNN's AMX/VNNI kernels: "
            "a second copy of the int8 weights in host memory (QWENSERVE_PACKED_INT8=0 turns "
            "this off)")

    def supports(self, a_q: torch.Tensor, w_q: torch.Tensor) -> bool:
        return (a_q.dtype == w_q.dtype == torch.int8 and a_q.is_cpu and a_q.dim() == 2
                and a_q.is_contiguous() and _is_packable(w_q))

    def __call__(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                 token_scale: torch.Tensor | None, int_bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
        """a_q [M, K] int8, w_q [N, K] int8, scale [N] float32, token_scale [M, 1] -> [M, N]."""
        scale = scale.float()
        if token_scale is not None and a_q.shape[0] == 1 and int_bias is None:
            # one row (batch-1 decode): its scale is a per-tensor one, which oneDNN applies
            # with the channel scales, writing out_dtype itself: no fp32 pass after the GEMM
            # (the scales multiply before the sum does, so fp32 results differ in the last bit)
            return _packed_int8_mm(a_q, self.packed(w_q), scale, None, float(token_scale),
                                   out_dtype)
        bias = None if int_bias is None else int_bias.float() * scale  # (acc + b) * s
        out = _packed_int8_mm(a_q, self.packed(w_q), scale, bias)
        if token_scale is not None:
            out.mul_(token_scale)
        return out.to(out_dtype)


class ScaledInt8Kernel(Protocol):
    """A native W8A8 GEMM with its scaling in the epilogue, on a packed copy of the weight
    (``native.gemm.Pigemm``)."""

    def pack(self, w: torch.Tensor) -> torch.Tensor: ...

    def scaled(self, a_q: torch.Tensor, packed: torch.Tensor, n: int, scale: torch.Tensor,
               token_scale: torch.Tensor | None, int_bias: torch.Tensor | None,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None
               ) -> torch.Tensor | None: ...

    def silu_mul(self, a_q: torch.Tensor, packed: torch.Tensor, n: int, scale: torch.Tensor,
                 token_scale: torch.Tensor | None, out_dtype: torch.dtype
                 ) -> torch.Tensor | None: ...


class PackedScaledInt8:
    """A native W8A8 GEMM (``ScaledInt8Kernel``) on a once-packed copy of each int8 weight:
    ``Igemm.scaled``'s contract (``int32_epilogue``'s values, a layer's float bias after them)
    with the weight's packing kept here."""

    def __init__(self, kernel: ScaledInt8Kernel) -> None:
        self.kernel = kernel
        self.packed = PackedWeights(
            kernel.pack, "int8 GEMMs read each weight packed once for the native AVX512-VNNI "
            "kernel (native/csrc/pigemm.cpp): a second copy of the int8 weights in host memory "
            "(QWENSERVE_PACKED_INT8=0 turns this off)")

    def scaled(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
               token_scale: torch.Tensor | None, int_bias: torch.Tensor | None,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """a_q [M, K] int8, w_q [N, K] int8, scale [N] float32, token_scale [M, 1] float32,
        int_bias [N] int32, bias [N] in out_dtype -> [M, N] in out_dtype; None for what the
        kernel does not take (a weight that is a view, other dtypes or shapes)."""
        if not self._takes(a_q, w_q):
            return None
        return self.kernel.scaled(a_q, self.packed(w_q), w_q.shape[0], scale, token_scale,
                                  int_bias, out_dtype, bias)

    def silu_mul(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                 token_scale: torch.Tensor | None, out_dtype: torch.dtype
                 ) -> torch.Tensor | None:
        """A W8A8 MLP's gate_up GEMM (w_q [2I, K]: gate rows, then up rows) and its
        SiLU-and-mul in one kernel -> [M, I] in out_dtype: ``scaled`` and elementwise's
        SiLU-and-mul bit for bit; None for what the kernel does not take."""
        if not self._takes(a_q, w_q):
            return None
        return self.kernel.silu_mul(a_q, self.packed(w_q), w_q.shape[0], scale, token_scale,
                                    out_dtype)

    @staticmethod
    def _takes(a_q: torch.Tensor, w_q: torch.Tensor) -> bool:
        """Whether w_q is an int8 weight this store packs (not a view) and x's rows fit it."""
        return w_q.dtype == torch.int8 and _is_packable(w_q) and a_q.shape[-1] == w_q.shape[1]


def _self_test(run: Callable[[], tuple[torch.Tensor, torch.Tensor]], what: str) -> bool:
    """Whether this torch build runs the packed kernel (``run`` gives it and its reference) and
    agrees; logs the fallback once otherwise."""
    try:
        got, want = run()
        if torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2):
            return True
    except (RuntimeError, AttributeError):
        pass
    logger.info("this torch build cannot pack %s weights for oneDNN; they use the plain kernel",
                what)
    return False


def _float_pair(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x, w, b = (torch.randn(3, 2, 32).to(dtype), torch.randn(16, 32).to(dtype),
               torch.randn(16).to(dtype))
    # the kernel's own two calls, without its log line
    return _packed_linear(x, _pack_float(w), b), torch.nn.functional.linear(x, w, b)


def _int8_pair() -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randint(-128, 128, (3, 36), dtype=torch.int8)
    w = torch.randint(-127, 128, (16, 36), dtype=torch.int8)
    scale = torch.rand(16)
    want = (a.int() @ w.int().t()).float() * scale
    return _packed_int8_mm(a, _pack_int8(w), scale, None), want


@functools.lru_cache(maxsize=4)
def packed_float_linear(dtype: torch.dtype) -> PackedFloatLinear | None:
    """The packed GEMM for ``dtype`` (bf16 or float32) where this torch build has it and it
    matches ``F.linear``."""
    name = "bf16" if dtype == torch.bfloat16 else "float32"
    ok = _self_test(lambda: _float_pair(dtype), name)
    return PackedFloatLinear(dtype) if ok else None


@functools.lru_cache(maxsize=1)
def packed_int8_matmul() -> PackedInt8Matmul | None:
    """The packed int8 GEMM where this torch build has it and it sums exactly."""
    return PackedInt8Matmul() if _self_test(_int8_pair, "int8") else None


def much_slower(candidate: Callable[[], object], reference: Callable[[], object],
                factor: float = 8.0) -> bool:
    """Whether ``candidate`` takes more than ``factor`` times ``reference``'s time (best of
    three each, after one call): a kernel on a reference (scalar) path, not a close call."""
    def best(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)
    return best(candidate) > factor * best(reference)


@functools.lru_cache(maxsize=1)
def int8_packing_pays() -> bool:
    """Whether oneDNN's packed int8 GEMM runs at a JIT kernel's speed here: on a Zen 5 EPYC
    (AVX512-VNNI, no AMX) it took its reference path, 0.2 GOP/s (512 rows of the 1152 x 896 qkv
    GEMM: 4.8 s, torch._int_mm 1.3 ms), which made W8A8's load-time warm-up take 7 minutes and
    every prefill GEMM seconds. Measured once per process on a small GEMM (a few ms where slow),
    against torch._int_mm on the same operands; logged where it does not pay."""
    a = torch.randint(-128, 128, (32, 256), dtype=torch.int8)
    w = torch.randint(-127, 128, (256, 256), dtype=torch.int8)
    packed, scale = _pack_int8(w), torch.ones(256)
    try:
        slow = much_slower(lambda: _packed_int8_mm(a, packed, scale, None),
                           lambda: torch._int_mm(a, w.t()))
    except (RuntimeError, AttributeError):  # no torch._int_mm: nothing faster to compare with
        return True
    if slow:
        logger.info("oneDNN's packed int8 GEMM runs far below torch._int_mm on this CPU (a "
                    "reference path): int8 GEMMs use torch._int_mm on the plain weight")
    return not slow
