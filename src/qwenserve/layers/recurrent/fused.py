"""The CPU Gated DeltaNet backend: fewer passes over memory than the reference, same maths.

- Decode (one token per sequence): a C++ kernel (``csrc/gdn_cpu.cpp``, plain C++ loaded with
  ctypes through ``qwenserve.native``) updates each state in
  place in its pool slot, reading it once for both products. The reference gathers every state
  out of the pool and scatters it back: at batch 64 that is ~5 passes over 64 MiB per layer,
  as much memory traffic as the weights of the whole model in fp32.
- Conv1d: the same C++ module runs the varlen depthwise conv straight from the conv-state pool.
- Prefill: the reference's chunked kernel. Its time is in batched GEMMs already (the three
  state-sized products per chunk, ~2/3 of it at 1 thread); merging ``w S`` and ``q S`` into one
  bmm of 2C rows was measured and did not pay for the extra copies (docs/benchmarks.md).

Without a C++ compiler (or with ``QWENSERVE_NATIVE=0``) decode and conv run the reference's
PyTorch code, after one log line from ``qwenserve.native``; so does decode with a state pool that
is not fp32 (``--mamba-ssm-cache-dtype``).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from qwenserve.layers.recurrent.base import GDNMetadata, RecurrentBackend
from qwenserve.layers.recurrent.delta_rule import prepare_qkv
from qwenserve.layers.recurrent.torch_ref import (
    causal_conv1d_varlen,
    chunked_prefill,
    recurrent_decode,
)
from qwenserve.native import load_library

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "gdn_cpu.cpp")
_P, _I = ctypes.c_void_p, ctypes.c_int64


class NativeGDN:
    """Typed face of ``csrc/gdn_cpu.cpp`` (pointers of contiguous CPU tensors)."""

    CONV = {torch.float32: "gdn_conv_f32", torch.bfloat16: "gdn_conv_bf16"}

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._decode = lib.gdn_decode_f32
        self._decode.argtypes = [_P] * 9 + [_I] * 4
        self._decode.restype = None
        self._conv = {}
        for dtype, name in self.CONV.items():
            fn = getattr(lib, name)
            fn.argtypes = [_P, _P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int]
            fn.restype = None
            self._conv[dtype] = fn

    def decode_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                    has_init: torch.Tensor) -> torch.Tensor:
        """q/k [B, H, Dk], v [B, H, Dv], g/beta [B, H] fp32 (prepared); pool [S, H, Dk, Dv] fp32
        contiguous, updated in place at ``slots`` -> o [B, H, Dv] fp32."""
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        slots, init = slots.to(torch.int64).contiguous(), has_init.to(torch.uint8).contiguous()
        b, h, dk = q.shape
        assert pool.shape[1:] == (h, dk, v.shape[2]) and pool.is_contiguous()
        out = torch.empty_like(v)
        self._decode(out.data_ptr(), pool.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                     g.data_ptr(), beta.data_ptr(), slots.data_ptr(), init.data_ptr(), b, h, dk,
                     v.shape[2])
        return out

    def supports_conv(self, x: torch.Tensor, conv_state: torch.Tensor) -> bool:
        return (x.dtype in self._conv and conv_state.dtype == x.dtype and x.device.type == "cpu"
                and conv_state.is_contiguous() and x.dim() == 2)

    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_state: torch.Tensor, meta: GDNMetadata, silu: bool) -> torch.Tensor:
        """As ``causal_conv1d_varlen`` (x [T, D], weight [D, K]); conv_state updated in place."""
        if x.stride(1) != 1:
            x = x.contiguous()
        weight_t = weight.reshape(weight.shape[0], -1).t().float().contiguous()  # [K, D]
        bias_f = None if bias is None else bias.float().contiguous()
        qsl = meta.query_start_loc.to(torch.int64).contiguous()
        slots = meta.state_slots.to(torch.int64).contiguous()
        init = meta.has_initial_state.to(torch.uint8).contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        self._conv[x.dtype](out.data_ptr(), x.data_ptr(), x.stride(0), weight_t.data_ptr(),
                            None if bias_f is None else bias_f.data_ptr(), conv_state.data_ptr(),
                            qsl.data_ptr(), slots.data_ptr(), init.data_ptr(), slots.numel(),
                            x.shape[1], weight_t.shape[0], int(silu))
        return out


@functools.cache
def native_ops() -> NativeGDN | None:
    """The compiled kernels, or None (the reason logged once by ``qwenserve.native``)."""
    lib = load_library("qwenserve_gdn_cpu", [_SOURCE])
    return None if lib is None else NativeGDN(lib)


def _decode_native(
    ops: NativeGDN, qkvgb: tuple[torch.Tensor, ...], pool: torch.Tensor, meta: GDNMetadata,
    out: torch.Tensor,
) -> None:
    rows = meta.decode_tokens
    q, k, v, g, beta = (t.index_select(0, rows) for t in qkvgb)  # contiguous [n, ...]
    o = ops.decode_step(q, k, v, g, beta, pool, meta.decode_slots, meta.decode_has_init)
    out.index_copy_(0, rows, o)


class FusedRecurrentBackend(RecurrentBackend):
    """CPU kernels: native decode and conv where they compile; the reference's chunked prefill."""

    name = "fused"
    chunk_size = 32  # as the reference: measured best on CPU for Qwen3.5 shapes

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        meta: GDNMetadata,
        activation: str | None = "silu",
    ) -> torch.Tensor:
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
        qkvgb = prepare_qkv(q, k, v, g, beta)
        num_tokens, heads, dv = v.shape
        out_rows = qkvgb[2].new_empty(num_tokens * heads + 1, dv)  # [T*Hv + 1, Dv] + dump row
        out = out_rows[:-1].view(num_tokens, heads, dv)  # [num_tokens, Hv, Dv]
        if meta.num_decodes:
            ops = native_ops()
            if ops is not None and ssm_state.dtype == torch.float32 \
                    and ssm_state.device.type == "cpu" and ssm_state.is_contiguous():
                _decode_native(ops, qkvgb, ssm_state, meta, out)
            else:
                recurrent_decode(qkvgb, ssm_state, meta, out)
        if meta.num_prefills:
            chunked_prefill(qkvgb, ssm_state, meta, out_rows)
        return out.to(v.dtype)
