"""The CPU Gated DeltaNet backend: fewer passes over memory than the reference, same maths.

- Decode (one token per sequence): a C++ kernel (``csrc/gdn_cpu.cpp``) updates each state in
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

import functools
import os
from types import ModuleType

import torch

from qwenserve.layers.recurrent.base import GDNMetadata, RecurrentBackend
from qwenserve.layers.recurrent.delta_rule import prepare_qkv
from qwenserve.layers.recurrent.torch_ref import (
    causal_conv1d_varlen,
    chunked_prefill,
    recurrent_decode,
)
from qwenserve.native import load_extension

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "gdn_cpu.cpp")


@functools.cache
def native_ops() -> ModuleType | None:
    """The compiled kernels, or None (the reason logged once by ``qwenserve.native``)."""
    return load_extension("qwenserve_gdn_cpu", [_SOURCE])


def _decode_native(
    ops: ModuleType, qkvgb: tuple[torch.Tensor, ...], pool: torch.Tensor, meta: GDNMetadata,
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
        if ops is None or x.device.type != "cpu" or conv_state.dtype != x.dtype \
                or not conv_state.is_contiguous() or activation not in (None, "silu", "swish"):
            return causal_conv1d_varlen(x, weight, bias, conv_state, meta.query_start_loc,
                                        meta.state_slots, meta.has_initial_state, activation)
        weight_t = weight.reshape(weight.shape[0], -1).t().float().contiguous()  # [K, conv_dim]
        empty = x.new_empty(0, dtype=torch.float32)
        return ops.causal_conv1d(x, weight_t, empty if bias is None else bias, conv_state,
                                 meta.query_start_loc, meta.state_slots, meta.has_initial_state,
                                 activation is not None)

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
