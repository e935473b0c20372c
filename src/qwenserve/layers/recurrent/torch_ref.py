"""Pure-PyTorch Gated DeltaNet kernels: the CPU path and the oracle for faster backends.

Varlen throughout: a step's tokens are packed ``[num_tokens, ...]``; states live in per-layer pools
(layouts in ``base.py``) and are read/written at each request's slot. Maths as HF's
``Qwen3_5GatedDeltaNet`` (qwen_arch.md §3.4/3.5); everything after the conv is computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwenserve.layers.recurrent.base import GDNMetadata, RecurrentBackend
from qwenserve.layers.recurrent.delta_rule import (
    chunk_rows,
    chunk_scan,
    chunk_terms,
    pack_chunks,
    prepare_qkv,
    recurrent_step,
    token_rows,
)

_ACTIVATIONS = {None: lambda t: t, "silu": F.silu, "swish": F.silu}


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv of width K over each request's tokens, all requests at once.

    Each request's tokens are laid out after K-1 history rows (its stored conv state, or zeros),
    so every token's window is K consecutive rows of ``xcat`` and the new state is the last K-1
    rows of the request's span (right even for requests shorter than K-1 tokens):

        xcat rows   | hist r0 | tokens r0 | hist r1 | tokens r1 | ...
        request r   hist at  qsl[r] + r*(K-1) + j              (j < K-1)
                    token t at  t + (r+1)*(K-1)                  (qsl[r] <= t < qsl[r+1])
                    new state = rows  qsl[r+1] + r*(K-1) + j

    x [num_tokens, conv_dim]; weight [conv_dim, K] or [conv_dim, 1, K] (weight[:, K-1] hits the
    current token); conv_state [num_state_slots, K-1, conv_dim], updated in place. Accumulates in fp32
    and applies the activation before the single cast back, as vLLM's causal_conv1d kernels do.
    """
    num_tokens, conv_dim = x.shape
    weight = weight.reshape(conv_dim, -1)
    hist = weight.shape[1] - 1
    qsl, slots = query_start_loc.long(), state_slots.long()
    num_reqs = slots.numel()
    req = torch.arange(num_reqs, device=x.device)  # [num_reqs]
    tok = torch.arange(num_tokens, device=x.device)  # [num_tokens]
    tok_req = torch.bucketize(tok, qsl[1:], right=True)  # [num_tokens] request of each token
    dest = tok + (tok_req + 1) * hist  # [num_tokens] row of each token in xcat
    offs = torch.arange(hist, device=x.device)  # [K-1]
    hist_rows = ((qsl[:-1] + req * hist)[:, None] + offs).reshape(-1)  # [num_reqs * (K-1)]
    prefix = conv_state[slots].to(x.dtype)  # [num_reqs, K-1, conv_dim]
    prefix = prefix.masked_fill(~has_initial_state.bool()[:, None, None], 0)
    xcat = x.new_empty(num_tokens + num_reqs * hist, conv_dim)  # [tokens + hist rows, conv_dim]
    xcat[hist_rows] = prefix.reshape(-1, conv_dim)
    xcat[dest] = x
    # Convolve every row of xcat with contiguous shifted views (no gathers), then keep the token
    # rows: row r of `acc` is the window xcat[r .. r + K-1], i.e. token t's window at dest[t]-hist.
    xf = xcat.float()
    rows = xf.shape[0] - hist
    acc = xf[hist:] * weight[:, hist].float()  # [rows, conv_dim] fp32
    for j in range(hist):
        acc.addcmul_(xf[j : j + rows], weight[:, j].float())
    if bias is not None:
        acc += bias.float()
    acc = acc.index_select(0, dest - hist)  # [num_tokens, conv_dim]
    new_rows = (qsl[1:] + req * hist)[:, None] + offs  # [num_reqs, K-1]
    conv_state.index_copy_(0, slots, xcat[new_rows].to(conv_state.dtype))
    return _ACTIVATIONS[activation](acc).to(x.dtype)


def save_conv_checkpoints(x: torch.Tensor, conv_state: torch.Tensor, meta: GDNMetadata) -> None:
    """The conv states of ``meta.checkpoints``: each the last K-1 raw rows before its point
    (from the request's stored history where it has fewer tokens before it). Call before the
    conv, which overwrites the live slots' history."""
    hist = conv_state.shape[1]
    for c in meta.checkpoints:
        rows = x[c.first_row : c.first_row + c.num_tokens]
        if c.num_tokens < hist:
            before = conv_state[c.live_slot] if c.has_initial_state \
                else conv_state.new_zeros(conv_state.shape[1:])
            rows = torch.cat([before.to(x.dtype), rows])
        conv_state[c.slot] = rows[rows.shape[0] - hist :].to(conv_state.dtype)


def _initial_states(
    pool: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor
) -> torch.Tensor:
    """Copy the slots' states out of the pool in fp32; zero where the request starts fresh (the
    slot may hold a previous owner's state, even NaNs, so mask rather than multiply)."""
    states = pool[slots].float()  # [n, Hv, Dk, Dv]
    if bool(has_init.all()):  # decodes nearly always continue a state: skip a pass over it
        return states
    return states.masked_fill_(~has_init[:, None, None, None], 0.0)


def decode_rows(
    prepared: tuple[torch.Tensor, ...], pool: torch.Tensor, slots: torch.Tensor,
    has_init: torch.Tensor,
) -> torch.Tensor:
    """One vectorised recurrent step of the decodes' prepared rows (q/k [n, Hv, Dk], v
    [n, Hv, Dv], g/beta [n, Hv]) from and back into their pool slots -> o [n, Hv, Dv] fp32."""
    states = _initial_states(pool, slots, has_init)
    o, states = recurrent_step(states, *prepared)  # [num_decodes, Hv, Dv]
    pool.index_copy_(0, slots, states.to(pool.dtype))
    return o


def recurrent_decode(
    qkvgb: tuple[torch.Tensor, ...], pool: torch.Tensor, meta: GDNMetadata, out: torch.Tensor
) -> None:
    """One vectorised recurrent step for every 1-token request."""
    rows = meta.decode_tokens
    prepared = tuple(t.index_select(0, rows) for t in qkvgb)
    out.index_copy_(0, rows, decode_rows(prepared, pool, meta.decode_slots, meta.decode_has_init))


def chunked_prefill(
    qkvgb: tuple[torch.Tensor, ...], pool: torch.Tensor, meta: GDNMetadata, out_rows: torch.Tensor
) -> None:
    """Chunked kernel over every multi-token request at once (layout in ``GDNMetadata``).

    out_rows [num_tokens*Hv + 1, Dv] is the flat output plus one dump row, the destination of
    every padding row, so the chunk output goes back in a single index_copy_.
    """
    heads, chunk_size = qkvgb[2].shape[1], meta.chunk_size
    rows = token_rows(meta.chunk_token, heads, chunk_size)  # [N*H*C]
    pad_rows = chunk_rows(meta.chunk_pad_pos, heads, chunk_size)  # [num_pad * H]
    packed = (pack_chunks(t, rows, pad_rows, chunk_size) for t in qkvgb)
    states = _initial_states(pool, meta.prefill_slots, meta.prefill_has_init)

    def save_checkpoints(step: int, states: torch.Tensor) -> None:
        for at, prefill, slot in meta.checkpoint_steps:
            if at == step:
                pool[slot] = states[prefill].to(pool.dtype)

    o, states = chunk_scan(chunk_terms(*packed), states, meta.active_per_step,
                           save_checkpoints if meta.checkpoint_steps else None)  # o [N,H,C,Dv]
    dest = rows.index_fill(0, pad_rows, out_rows.shape[0] - 1)  # padding -> the dump row
    out_rows.index_copy_(0, dest, o.view(-1, o.shape[-1]))
    pool.index_copy_(0, meta.prefill_slots, states.to(pool.dtype))


def gated_delta_net_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    meta: GDNMetadata,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Gated delta rule over a mixed decode/prefill varlen batch; updates ``ssm_state`` in place.

    q, k [num_tokens, Hk, Dk] and v [num_tokens, Hv, Dv] are the conv outputs (Hv a multiple of
    Hk: value head h reads key head h // (Hv/Hk)); g (log decay) and beta [num_tokens, Hv];
    ssm_state [num_state_slots, Hv, Dk, Dv]. Returns o [num_tokens, Hv, Dv] in v's dtype.
    """
    qkvgb = prepare_qkv(q, k, v, g, beta, use_qk_l2norm)
    num_tokens, heads, dv = v.shape
    out_rows = qkvgb[2].new_empty(num_tokens * heads + 1, dv)  # [T*Hv + 1, Dv] fp32, + dump row
    out = out_rows[:-1].view(num_tokens, heads, dv)  # [num_tokens, Hv, Dv]
    if meta.num_decodes:
        recurrent_decode(qkvgb, ssm_state, meta, out)
    if meta.num_prefills:
        chunked_prefill(qkvgb, ssm_state, meta, out_rows)
    return out.to(v.dtype)


class TorchRefRecurrentBackend(RecurrentBackend):
    """The reference backend: runs on any device torch supports, slowly but exactly."""

    name = "torch_ref"
    # Measured on CPU (fp32, Qwen3.5-0.8B shapes, 2k-token prefill): 32 is ~20% faster than 64;
    # smaller chunks halve the intra-chunk matmuls, while the state-sized ones stay the same.
    chunk_size = 32

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
        return causal_conv1d_varlen(
            x,
            weight,
            bias,
            conv_state,
            meta.query_start_loc,
            meta.state_slots,
            meta.has_initial_state,
            activation,
        )

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
        return gated_delta_net_forward(q, k, v, g, beta, ssm_state, meta)
