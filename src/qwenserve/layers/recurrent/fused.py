"""The CPU Gated DeltaNet backend: fewer passes over memory than the reference, same maths.

Five C++ kernels (``csrc/gdn_cpu.cpp``, plain C++ loaded with ctypes through
``qwenserve.native``); the first three read and write the state pools in place:

- Decode (one token per sequence): each state is updated in its pool slot, read once for both
  products. The reference gathers every state out of the pool and scatters it back: at batch 64
  that is ~5 passes over 64 MiB per layer, as much memory traffic as the fp32 model's weights.
- Prefill: the chunked form, one task per (prefill, value head) with its chunks in order. It
  reads the conv output as it lies (q/k/v are strided views of it), l2-normalises and scales
  q/k and sums the log decays while packing a chunk, solves the chunk's triangular system by
  forward substitution, and runs every product through one register-blocked tile with the
  state in L2 (a column panel of it in L1). No padding to whole chunks, no gather of the
  states, the outputs written in place. The reference builds each of these as a separate
  batched PyTorch op over the whole step.
- Conv1d: the varlen depthwise conv straight from the conv-state pool, SiLU vectorised.
- Gated RMSNorm (the layer's last op): one pass, reading the gate rows in place.
- Gating (g and beta from the a/b projections): one pass instead of five PyTorch ops, so that
  a decode step's Gated DeltaNet layer is native kernels only (``worker/decode_replay.py``).

Without a C++ compiler (or with ``QWENSERVE_NATIVE=0``) every path runs the reference's PyTorch
code, after one log line from ``qwenserve.native``; so does any input the kernels do not take
(layer tensors other than fp32/bf16, a state pool other than fp32/bf16/f16 (f16 needs F16C), a
head dim not a multiple of 8, a non-CPU tensor).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from qwenserve.layers.recurrent.base import GDNMetadata, RecurrentBackend, static_copy
from qwenserve.layers.recurrent.delta_rule import prepare_qkv
from qwenserve.layers.recurrent.torch_ref import (
    causal_conv1d_varlen,
    chunked_prefill,
    decode_rows,
    save_conv_checkpoints,
)
from qwenserve.native import load_library
from qwenserve.native.attention import heads_rows
from qwenserve.native.build import CSRC, DEFAULT_CFLAGS
from qwenserve.platforms.cpu_packed_gemm import PackedWeights

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "gdn_cpu.cpp")
# FMA contraction: ISO C++ modes (-std=c++17) leave a * b + c unfused otherwise. The native
# kernels' csrc/ for vec_math.h's 16-lane SiLU (its headers join the build's cache key).
_CFLAGS = (*DEFAULT_CFLAGS, "-ffp-contract=fast", f"-I{CSRC}")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the layer tensors'
_F16_POOL_CODE = 2  # a float16 state pool, where the build has F16C (gdn_has_f16_pool)


class _ChunkArgs(ctypes.Structure):
    """``ChunkArgs`` of ``csrc/gdn_cpu.cpp``, field for field."""

    _fields_ = [("q", _P), ("k", _P), ("v", _P), ("q_stride", _I), ("k_stride", _I),
                ("v_stride", _I), ("g", _P), ("beta", _P), ("pool", _P), ("out", _P),
                ("starts", _P), ("lens", _P), ("slots", _P), ("has_init", _P),
                ("checkpoint_lens", _P), ("checkpoint_slots", _P), ("num_prefills", _I),
                ("Hk", _I), ("Hv", _I), ("Dk", _I), ("Dv", _I), ("C", _I)]


class NativeGDN:
    """Typed face of ``csrc/gdn_cpu.cpp`` (pointers of CPU tensors)."""

    CONV = {torch.float32: "gdn_conv_f32", torch.bfloat16: "gdn_conv_bf16"}
    GATED_NORM = {torch.float32: "gdn_gated_norm_f32", torch.bfloat16: "gdn_gated_norm_bf16"}
    GATING = {torch.float32: "gdn_gating_f32", torch.bfloat16: "gdn_gating_bf16"}

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._decode = lib.gdn_decode_f32
        self._decode.argtypes = [_P] * 9 + [_I] * 4
        self._decode.restype = None
        self._decode_rows = lib.gdn_decode_rows
        self._decode_rows.argtypes = [_P] * 5 + [_I] * 3 + [_P] * 5 + [_I] * 5 + [ctypes.c_int] * 2
        self._decode_rows.restype = ctypes.c_int
        self._conv = {}
        # each conv weight [D, K] as the kernel reads it, [K, D] float32, made once: per call it
        # cost 0.1 ms a layer in a 64-sequence decode step (1.7 ms of a Qwen3.5-0.8B step)
        self._conv_weights = PackedWeights(_conv_weight_t)
        for dtype, name in self.CONV.items():
            fn = getattr(lib, name)
            fn.argtypes = [_P, _P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int]
            fn.restype = None
            self._conv[dtype] = fn
        self._gated_norm = {}
        for dtype, name in self.GATED_NORM.items():
            fn = getattr(lib, name)
            fn.argtypes = [_P] * 4 + [_I] * 7 + [ctypes.c_float]
            fn.restype = None
            self._gated_norm[dtype] = fn
        self._gating = {}
        for dtype, name in self.GATING.items():
            fn = getattr(lib, name)
            fn.argtypes = [_P] * 4 + [_I] * 2 + [_P] * 2 + [_I] * 2
            fn.restype = None
            self._gating[dtype] = fn
        self.pool_codes = dict(_DTYPE_CODES)
        if lib.gdn_has_f16_pool():
            self.pool_codes[torch.float16] = _F16_POOL_CODE
        self._chunk = lib.gdn_chunk
        self._chunk.argtypes = [ctypes.POINTER(_ChunkArgs), ctypes.c_int, ctypes.c_int]
        self._chunk.restype = ctypes.c_int
        lib.gdn_chunk_size.restype = ctypes.c_int64
        self.preferred_chunk_size = int(lib.gdn_chunk_size())  # 16 with AVX512, else 32

    def decode_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                    has_init: torch.Tensor) -> torch.Tensor:
        """q/k [B, H, Dk], v [B, H, Dv], g/beta [B, H] fp32 (prepared); pool [S, H, Dk, Dv] fp32
        contiguous, updated in place at ``slots`` -> o [B, H, Dv] fp32."""
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        slots, init = slots.to(torch.int64).contiguous(), _bytes(has_init)
        b, h, dk = q.shape
        assert pool.shape[1:] == (h, dk, v.shape[2]) and pool.is_contiguous()
        out = torch.empty_like(v)
        self._decode(out.data_ptr(), pool.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                     g.data_ptr(), beta.data_ptr(), slots.data_ptr(), init.data_ptr(), b, h, dk,
                     v.shape[2])
        return out

    def supports_decode_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             pool: torch.Tensor, out: torch.Tensor) -> bool:
        return (q.dtype in _DTYPE_CODES and k.dtype == v.dtype == out.dtype == q.dtype
                and pool.dtype in self.pool_codes and pool.is_contiguous()
                and out.is_contiguous() and q.device.type == pool.device.type == "cpu"
                and q.shape[-1] % 8 == 0 and v.shape[1] % k.shape[1] == 0)

    def decode_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, pool: torch.Tensor, meta: GDNMetadata,
                    out: torch.Tensor) -> None:
        """The decodes' rows of out [T, Hv, Dv] (q's dtype, contiguous) from the layer's own q,
        k [T, Hk, Dk] and v [T, Hv, Dv] (q/k not yet normalised) and g/beta [T, Hv]: the
        preparation (normalising, head repeat, fp32) happens in the kernel."""
        q, k, v = heads_rows(q), heads_rows(k), heads_rows(v)
        g, beta = g.float().contiguous(), beta.float().contiguous()
        ints = [t.to(torch.int64).contiguous() for t in (meta.decode_tokens, meta.decode_slots)]
        init = _bytes(meta.decode_has_init)
        if self._decode_rows(
                out.data_ptr(), pool.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                q.stride(0), k.stride(0), v.stride(0), g.data_ptr(), beta.data_ptr(),
                ints[0].data_ptr(), ints[1].data_ptr(), init.data_ptr(), meta.num_decodes,
                q.shape[1], v.shape[1], q.shape[2], v.shape[2], _DTYPE_CODES[q.dtype],
                self.pool_codes[pool.dtype]):
            raise RuntimeError("gdn_decode_rows refused dtypes that supports_decode_rows took")

    def supports_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         pool: torch.Tensor) -> bool:
        return (q.dtype in _DTYPE_CODES and k.dtype == v.dtype == q.dtype
                and pool.dtype in self.pool_codes and pool.is_contiguous()
                and q.device.type == pool.device.type == "cpu"
                and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0
                and v.shape[1] % k.shape[1] == 0)

    def chunk_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, pool: torch.Tensor, meta: GDNMetadata,
                      out: torch.Tensor, chunk_size: int) -> None:
        """Every prefill of the step (``meta.prefill_*``) in chunks of ``chunk_size`` (one cut
        short where a state checkpoint is saved, ``meta.prefill_checkpoint_*``): q, k
        [T, Hk, Dk], v [T, Hv, Dv] as the conv left them (q/k not yet normalised), g/beta
        [T, Hv]; reads and writes the pool in place and the prefills' rows of out [T, Hv, Dv]
        (contiguous, q's dtype)."""
        q, k, v = heads_rows(q), heads_rows(k), heads_rows(v)
        g, beta = g.float().contiguous(), beta.float().contiguous()
        ints = [t.to(torch.int64).contiguous() for t in
                (meta.prefill_starts, meta.prefill_lens, meta.prefill_slots)]
        saves = [t.to(torch.int64).contiguous() for t in
                 (meta.prefill_checkpoint_lens, meta.prefill_checkpoint_slots)]
        init = _bytes(meta.prefill_has_init)
        args = _ChunkArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0),
                          v.stride(0), g.data_ptr(), beta.data_ptr(), pool.data_ptr(),
                          out.data_ptr(), *(t.data_ptr() for t in ints), init.data_ptr(),
                          *(t.data_ptr() for t in saves), meta.num_prefills, q.shape[1],
                          v.shape[1], q.shape[2], v.shape[2], chunk_size)
        if self._chunk(ctypes.byref(args), _DTYPE_CODES[q.dtype], self.pool_codes[pool.dtype]):
            raise ValueError(f"gdn_chunk: unsupported shapes q {tuple(q.shape)}, "
                             f"v {tuple(v.shape)}, chunk size {chunk_size}")

    def supports_conv(self, x: torch.Tensor, conv_state: torch.Tensor) -> bool:
        return (x.dtype in self._conv and conv_state.dtype == x.dtype and x.device.type == "cpu"
                and conv_state.is_contiguous() and x.dim() == 2)

    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_state: torch.Tensor, meta: GDNMetadata, silu: bool) -> torch.Tensor:
        """As ``causal_conv1d_varlen`` (x [T, D], weight [D, K]); conv_state updated in place."""
        if x.stride(1) != 1:
            x = x.contiguous()
        weight_t = self._conv_weights(weight)  # [K, D] float32
        bias_f = None if bias is None else bias.float().contiguous()
        qsl = meta.query_start_loc.to(torch.int64).contiguous()
        slots = meta.state_slots.to(torch.int64).contiguous()
        init = _bytes(meta.has_initial_state)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._conv[x.dtype](out.data_ptr(), x.data_ptr(), x.stride(0), weight_t.data_ptr(),
                            None if bias_f is None else bias_f.data_ptr(), conv_state.data_ptr(),
                            qsl.data_ptr(), slots.data_ptr(), init.data_ptr(), slots.numel(),
                            x.shape[1], weight_t.shape[0], int(silu))
        return out


    def supports_gating(self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                        dt_bias: torch.Tensor) -> bool:
        return (a.dtype in self._gating and b.dtype == a.dtype and a.is_cpu and b.is_cpu
                and a.dim() == b.dim() == 2 and a.shape == b.shape
                and a.stride(1) == b.stride(1) == 1
                and A_log.dtype == dt_bias.dtype == torch.float32
                and A_log.is_contiguous() and dt_bias.is_contiguous()
                and A_log.numel() == dt_bias.numel() == a.shape[1])

    def gating(self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``RecurrentBackend.gating``: a, b [T, H] rows read where they lie -> (g, beta)
        [T, H] float32."""
        g = torch.empty(a.shape, dtype=torch.float32)
        beta = torch.empty(a.shape, dtype=torch.float32)
        self._gating[a.dtype](g.data_ptr(), beta.data_ptr(), a.data_ptr(), b.data_ptr(),
                              a.stride(0), b.stride(0), A_log.data_ptr(), dt_bias.data_ptr(),
                              a.shape[0], a.shape[1])
        return g, beta

    def supports_gated_norm(self, x: torch.Tensor, gate: torch.Tensor,
                            weight: torch.Tensor) -> bool:
        return (x.dtype in self._gated_norm and gate.dtype == weight.dtype == x.dtype
                and x.is_cpu and gate.is_cpu and x.dim() == gate.dim() == 3
                and x.shape == gate.shape and x.stride(2) == gate.stride(2) == 1
                and weight.dim() == 1 and weight.numel() == x.shape[2])

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
        """As ``rms_norm_gated``: x, gate [T, H, D] (rows read where they lie), weight [D]
        -> a new contiguous [T, H, D]."""
        out = torch.empty(x.shape, dtype=x.dtype)
        weight = weight.contiguous()
        self._gated_norm[x.dtype](out.data_ptr(), x.data_ptr(), gate.data_ptr(),
                                  weight.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                                  x.stride(1), gate.stride(0), gate.stride(1), x.shape[2], eps)
        return out


def _bytes(flags: torch.Tensor) -> torch.Tensor:
    """A bool tensor as the bytes the kernels read: a view (no copy a recorded step would miss)."""
    flags = flags.contiguous()
    return flags.view(torch.uint8) if flags.dtype == torch.bool else flags.to(torch.uint8)


def _conv_weight_t(weight: torch.Tensor) -> torch.Tensor:
    return weight.reshape(weight.shape[0], -1).t().float().contiguous()


@functools.cache
def native_ops() -> NativeGDN | None:
    """The compiled kernels, or None (the reason logged once by ``qwenserve.native``)."""
    lib = load_library("qwenserve_gdn_cpu", [_SOURCE], cflags=_CFLAGS)
    return None if lib is None else NativeGDN(lib)


def _decode(ops: NativeGDN | None, raw: tuple[torch.Tensor, ...], pool: torch.Tensor,
            meta: GDNMetadata, out: torch.Tensor) -> None:
    """The decodes' rows of out; only those rows are prepared (normalised, heads repeated)."""
    if ops is not None and ops.supports_decode_rows(*raw[:3], pool, out):
        ops.decode_rows(*raw, pool, meta, out)
        return
    rows = meta.decode_tokens
    prepared = prepare_qkv(*(t.index_select(0, rows) for t in raw))  # [n, ...] fp32
    slots, init = meta.decode_slots, meta.decode_has_init
    if ops is not None and pool.dtype == torch.float32 and pool.device.type == "cpu" \
            and pool.is_contiguous():
        o = ops.decode_step(*prepared, pool, slots, init)
    else:
        o = decode_rows(prepared, pool, slots, init)
    out.index_copy_(0, rows, o.to(out.dtype))


def _reference_prefill(ops: NativeGDN | None, raw: tuple[torch.Tensor, ...], pool: torch.Tensor,
                       meta: GDNMetadata) -> torch.Tensor:
    """The reference's chunked prefill (the native decode step still where it applies)."""
    qkvgb = prepare_qkv(*raw)
    num_tokens, heads, dv = raw[2].shape
    out_rows = qkvgb[2].new_empty(num_tokens * heads + 1, dv)  # [T*Hv + 1, Dv] + dump row
    out = out_rows[:-1].view(num_tokens, heads, dv)  # [num_tokens, Hv, Dv] fp32
    if meta.num_decodes:
        _decode(ops, raw, pool, meta, out)
    chunked_prefill(qkvgb, pool, meta, out_rows)
    return out.to(raw[2].dtype)


class FusedRecurrentBackend(RecurrentBackend):
    """CPU kernels: native decode, chunked prefill and conv where they compile."""

    name = "fused"
    chunk_size = 32  # the reference's layout (the fallback): measured best on CPU
    # The C++ prefill's chunks: None takes the build's own (NativeGDN.preferred_chunk_size:
    # 16 with AVX512, 32 otherwise; docs/benchmarks.md); tests and benchmarks set one.
    native_chunk_size: int | None = None

    def replay_metadata(self, meta: GDNMetadata) -> GDNMetadata | None:
        # a decode step's every op is then a native call reading the metadata's buffers
        if meta.num_prefills or not meta.num_decodes or native_ops() is None:
            return None
        return static_copy(meta)

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        meta: GDNMetadata,
        activation: str | None = "silu",
    ) -> torch.Tensor:
        save_conv_checkpoints(x, conv_state, meta)
        ops = native_ops()
        if ops is None or not ops.supports_conv(x, conv_state) \
                or activation not in (None, "silu", "swish"):
            return causal_conv1d_varlen(x, weight, bias, conv_state, meta.query_start_loc,
                                        meta.state_slots, meta.has_initial_state, activation)
        return ops.causal_conv1d(x, weight, bias, conv_state, meta, activation is not None)

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm_state: torch.Tensor,
        meta: GDNMetadata,
    ) -> torch.Tensor:
        ops = native_ops()
        if meta.num_prefills and (ops is None or not ops.supports_prefill(q, k, v, ssm_state)):
            return _reference_prefill(ops, (q, k, v, g, beta), ssm_state, meta)
        out = torch.empty(v.shape, dtype=v.dtype)  # [num_tokens, Hv, Dv]
        if meta.num_decodes:
            _decode(ops, (q, k, v, g, beta), ssm_state, meta, out)
        if meta.num_prefills:
            assert ops is not None
            ops.chunk_prefill(q, k, v, g, beta, ssm_state, meta, out,
                              self.native_chunk_size or ops.preferred_chunk_size)
        return out

    def gating(
        self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = native_ops()
        if ops is None or not ops.supports_gating(a, b, A_log, dt_bias):
            return super().gating(a, b, A_log, dt_bias)
        return ops.gating(a, b, A_log, dt_bias)

    def gated_rms_norm(
        self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        ops = native_ops()
        if ops is None or not ops.supports_gated_norm(x, gate, weight):
            return super().gated_rms_norm(x, gate, weight, eps)
        return ops.gated_rms_norm(x, gate, weight, eps)
