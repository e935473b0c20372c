"""The CPU Gated DeltaNet backend: fewer passes over memory than the reference, same maths.

- Decode (one token per sequence): a C++ kernel (``csrc/gdn_cpu.cpp``) updates each state in
  place in its pool slot, reading it once for both products. The reference gathers every state
  out of the pool and scatters it back: at batch 64 that is ~5 passes over 64 MiB per layer,
  as much memory traffic as the weights of the whole model in fp32.
- Conv1d: the same C++ module runs the varlen depthwise conv straight from the conv-state pool.
- Prefill: the reference's chunked kernel with the two products that read the incoming state
  (``w S`` and ``q S``) merged into one batched matmul per scan step (2C rows instead of C:
  more work per call on a small GEMM).

Without a C++ compiler (or with ``QWENSERVE_NATIVE=0``) decode and conv run the reference's
PyTorch code, after one log line from ``qwenserve.native``.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from qwenserve.layers.recurrent.base import GDNMetadata, RecurrentBackend
from qwenserve.layers.recurrent.delta_rule import (
    ChunkTerms,
    chunk_rows,
    chunk_terms,
    pack_chunks,
    prepare_qkv,
    token_rows,
)
from qwenserve.layers.recurrent.torch_ref import (
    _decode,
    _initial_states,
    causal_conv1d_varlen,
)
from qwenserve.native import load_extension

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "gdn_cpu.cpp")


@functools.cache
def native_ops() -> ModuleType | None:
    """The compiled kernels, or None (the reason logged once by ``qwenserve.native``)."""
    return load_extension("qwenserve_gdn_cpu", [_SOURCE])


def merged_chunk_scan(
    terms: ChunkTerms, states: torch.Tensor, active_per_step: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta_rule.chunk_scan`` with ``w S`` and ``q S`` as one bmm per step (same results).

    states [R, H, Dk, Dv] (updated in place) -> (o [N, H, C, Dv], final states).
    """
    num_chunks, heads, chunk_size, dv = terms.u.shape
    wq = torch.cat((terms.w, terms.q_dec), dim=2)  # [N, H, 2C, Dk]: w rows, then q rows

    def flat(t: torch.Tensor, n: int, first: int = 0) -> torch.Tensor:  # [n*H, rows, cols]
        return t[first : first + n].flatten(0, 1)

    out = terms.u.new_empty(num_chunks, heads, chunk_size, dv)  # [N, H, C, Dv]
    first = 0
    for n in active_per_step:
        s = flat(states, n)  # [n*H, Dk, Dv] view: updated in place below
        read = torch.bmm(flat(wq, n, first), s)  # [n*H, 2C, Dv]: w S, then q S
        v_new = torch.sub(flat(terms.u, n, first), read[:, :chunk_size])
        o = flat(out, n, first)
        torch.baddbmm(read[:, chunk_size:], flat(terms.attn, n, first), v_new, out=o)
        s.mul_(flat(terms.chunk_decay, n, first)[..., None, None])
        s.baddbmm_(flat(terms.k_dec, n, first).mT, v_new)
        first += n
    return out, states


def _prefill(
    qkvgb: tuple[torch.Tensor, ...], pool: torch.Tensor, meta: GDNMetadata, out_rows: torch.Tensor
) -> None:
    """As ``torch_ref._prefill``, with the merged scan."""
    heads, chunk_size = qkvgb[2].shape[1], meta.chunk_size
    rows = token_rows(meta.chunk_token, heads, chunk_size)  # [N*H*C]
    pad_rows = chunk_rows(meta.chunk_pad_pos, heads, chunk_size)  # [num_pad * H]
    packed = (pack_chunks(t, rows, pad_rows, chunk_size) for t in qkvgb)
    states = _initial_states(pool, meta.prefill_slots, meta.prefill_has_init)
    o, states = merged_chunk_scan(chunk_terms(*packed), states, meta.active_per_step)
    dest = rows.index_fill(0, pad_rows, out_rows.shape[0] - 1)  # padding -> the dump row
    out_rows.index_copy_(0, dest, o.view(-1, o.shape[-1]))
    pool.index_copy_(0, meta.prefill_slots, states.to(pool.dtype))


def _decode_native(
    ops: ModuleType, qkvgb: tuple[torch.Tensor, ...], pool: torch.Tensor, meta: GDNMetadata,
    out: torch.Tensor,
) -> None:
    rows = meta.decode_tokens
    q, k, v, g, beta = (t.index_select(0, rows) for t in qkvgb)  # contiguous [n, ...]
    o = ops.decode_step(q, k, v, g, beta, pool, meta.decode_slots, meta.decode_has_init)
    out.index_copy_(0, rows, o)


class FusedRecurrentBackend(RecurrentBackend):
    """CPU kernels: native decode and conv where they compile, the merged chunk scan always."""

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
                or activation not in (None, "silu", "swish"):
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
                _decode(qkvgb, ssm_state, meta, out)
        if meta.num_prefills:
            _prefill(qkvgb, ssm_state, meta, out_rows)
        return out.to(v.dtype)
