"""The gated delta rule in fp32: the one-token recurrence and the chunked (parallel) form.

Per value head, with S in R^{Dk x Dv} (qwen_arch.md §3.4):

    S_t = exp(g_t) * S_{t-1};  S_t += k_t (beta_t * (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t

The chunked form (§3.5; HF ``torch_chunk_gated_delta_rule``, fla ``chunk_gated_delta_rule``)
solves each chunk of C tokens with a unit-lower-triangular system, then scans over chunks. Its
per-chunk terms are built for every chunk of every request in one batch; only the scan is serial.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6, scale: float = 1.0) -> torch.Tensor:
    """scale * x / sqrt(sum(x^2) + eps) over the last dim (FLA's use_qk_l2norm_in_kernel)."""
    sum_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_()  # one fused pass
    return x * (torch.rsqrt(sum_sq + eps) * scale)


def prepare_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, ...]:
    """fp32 copies with q/k l2-normalised, q scaled by Dk**-0.5 and q/k heads repeated to Hv.

    q, k [..., Hk, Dk], v [..., Hv, Dv]; value head h reads key head h // (Hv // Hk).
    """
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q, scale=q.shape[-1] ** -0.5), l2norm(k)
    else:
        q = q * q.shape[-1] ** -0.5
    groups = v.shape[-2] // k.shape[-2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    return q, k, v.float(), g.float(), beta.float()


def recurrent_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for N independent sequences: state [N, H, Dk, Dv] (fp32, updated in place),
    q/k [N, H, Dk], v [N, H, Dv], g/beta [N, H] (prepared) -> (o [N, H, Dv], the state).

    Decode is memory-bound on the state (1 MiB per head group and sequence), so S is read once
    for both products and updated in place. With S' = e^g S + k delta^T:
        kv_mem = e^g S^T k,   delta = beta (v - kv_mem),   o = S'^T q = e^g S^T q + (k.q) delta
    """
    n, h, dk, dv = state.shape
    flat = state.view(n * h, dk, dv)
    read = torch.bmm(torch.stack((k, q), dim=2).view(n * h, 2, dk), flat)  # [NH, 2, Dv]
    decay = g.exp()  # [N, H]
    read = read.view(n, h, 2, dv) * decay[..., None, None]
    delta = (v - read[:, :, 0]) * beta[..., None]  # [N, H, Dv]
    o = read[:, :, 1] + (k * q).sum(-1, keepdim=True) * delta
    flat.mul_(decay.view(n * h, 1, 1)).baddbmm_(k.reshape(n * h, dk, 1),
                                                 delta.reshape(n * h, 1, dv))
    return o, state


@dataclass(frozen=True)
class ChunkTerms:
    """Everything the chunk scan needs, per chunk n and head h (γ = cumsum of g in the chunk)."""

    u: torch.Tensor  # [N, H, C, Dv]  A^{-1} (beta v)              "new values"
    w: torch.Tensor  # [N, H, C, Dk]  A^{-1} (beta exp(γ) k)       reads the incoming state
    attn: torch.Tensor  # [N, H, C, C]   (q k^T) ⊙ exp(γ_i - γ_j), j <= i
    q_dec: torch.Tensor  # [N, H, C, Dk] exp(γ) q
    k_dec: torch.Tensor  # [N, H, C, Dk] exp(γ_C - γ) k
    chunk_decay: torch.Tensor  # [N, H]   exp(γ_C)


def chunk_rows(padded_pos: torch.Tensor, heads: int, chunk_size: int) -> torch.Tensor:
    """Flat rows of chunk-layout positions in a head-major tensor [N, H, C, ...] viewed as
    [N*H*C, ...]: position p is chunk n = p // C, row c = p % C of every head, i.e. flat rows
    (n*H + h)*C + c. Returns [len(padded_pos) * H], position-major."""
    base = (padded_pos // chunk_size) * heads * chunk_size + padded_pos % chunk_size  # [n]
    per_head = torch.arange(heads, device=padded_pos.device) * chunk_size  # [H]
    return (base[:, None] + per_head).reshape(-1)


def token_rows(chunk_token: torch.Tensor, heads: int, chunk_size: int) -> torch.Tensor:
    """For each flat row (n*H + h)*C + c of a head-major chunk tensor, the flat row
    ``chunk_token[n*C + c]*H + h`` of the token-major [num_tokens, H, ...] tensor it mirrors."""
    per_head = torch.arange(heads, device=chunk_token.device).view(1, heads, 1)  # [1, H, 1]
    return (chunk_token.view(-1, 1, chunk_size) * heads + per_head).reshape(-1)  # [N*H*C]


def pack_chunks(
    t: torch.Tensor, source_rows: torch.Tensor, pad_rows: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Gather token-major t [num_tokens, H, ...] into a head-major chunk tensor [N, H, C, ...]
    (so the chunk maths are plain batched matmuls) at ``source_rows`` (``token_rows``). The
    padding rows (flat ``pad_rows``) are zeroed: with beta = g = 0 they leave S untouched."""
    heads, tail = t.shape[1], t.shape[2:]
    packed = t.reshape(-1, *tail).index_select(0, source_rows)  # [N*H*C, ...]
    return packed.index_fill_(0, pad_rows, 0).view(-1, heads, chunk_size, *tail)


def chunk_terms(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> ChunkTerms:
    """Intra-chunk terms: q/k [N, H, C, Dk], v [N, H, C, Dv], g/beta [N, H, C] (prepared).

    Overwrites q and k (they become ``q_dec`` and ``k_dec``): no extra [N, H, C, Dk] buffers.
    """
    chunk_size = q.shape[2]
    gamma = g.cumsum(dim=-1)  # [N, H, C]
    gamma_exp = gamma.exp()  # [N, H, C]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # exp(γ_i - γ_j) for j <= i; -inf above the diagonal so exp() cannot overflow there
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # A = I + strict_lower(beta_i k_i.k_j Γ_ij); unitriangular=True ignores the diagonal. As in
    # fla, A is inverted explicitly (one C x C solve); the row scalings of V and K by beta and
    # exp(γ) become column scalings of A^{-1}, which are cheaper ([C, C] < [C, D]).
    system = (k @ k.mT).mul_(decay).mul_(beta[..., :, None])  # [N, H, C, C]
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device).expand_as(system)
    inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    u = (inverse * beta[..., None, :]) @ v  # [N, H, C, Dv]
    w = inverse.mul_((beta * gamma_exp)[..., None, :]) @ k  # [N, H, C, Dk]
    attn = (q @ k.mT).mul_(decay)  # [N, H, C, C]
    return ChunkTerms(
        u=u,
        w=w,
        attn=attn,
        q_dec=q.mul_(gamma_exp[..., None]),
        k_dec=k.mul_((gamma[..., -1:] - gamma).exp()[..., None]),
        chunk_decay=gamma_exp[..., -1],
    )


def chunk_scan(
    terms: ChunkTerms, states: torch.Tensor, active_per_step: tuple[int, ...],
    after_step: Callable[[int, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry each request's state across its chunks, all requests together; in place on states.

    Requests are sorted longest first and chunks laid out step-major (``GDNMetadata``), so at
    step i the running requests are the first ``active_per_step[i]`` and their chunks one
    contiguous block. states [R, H, Dk, Dv] -> (o [N, H, C, Dv], final states);
    ``after_step(i, states)`` sees them after each step i (state checkpoints).
    """
    num_chunks, heads, chunk_size, dv = terms.u.shape

    def flat(t: torch.Tensor, n: int, first: int = 0) -> torch.Tensor:  # [n*H, rows, cols]
        return t[first : first + n].flatten(0, 1)

    out = terms.u.new_empty(num_chunks, heads, chunk_size, dv)  # [N, H, C, Dv]
    first = 0
    for step, n in enumerate(active_per_step):
        s = flat(states, n)  # [n*H, Dk, Dv] view: updated in place below
        v_new = torch.baddbmm(flat(terms.u, n, first), flat(terms.w, n, first), s, alpha=-1)
        o = flat(out, n, first)
        torch.bmm(flat(terms.q_dec, n, first), s, out=o)
        o.baddbmm_(flat(terms.attn, n, first), v_new)
        s.mul_(flat(terms.chunk_decay, n, first)[..., None, None])
        s.baddbmm_(flat(terms.k_dec, n, first).mT, v_new)
        first += n
        if after_step is not None:
            after_step(step, states)
    return out, states


def _initial(state: torch.Tensor | None, v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    if state is not None:
        return state.float().clone()
    return v.new_zeros(v.shape[1], k.shape[-1], v.shape[-1])  # [Hv, Dk, Dv]


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence token by token: q/k [T, Hk, Dk], v [T, Hv, Dv], g/beta [T, Hv], state
    [Hv, Dk, Dv] -> (o [T, Hv, Dv] fp32, final state fp32). The oracle for the chunked form."""
    q, k, v, g, beta = prepare_qkv(q, k, v, g, beta, use_qk_l2norm)
    state = _initial(initial_state, v, k)[None]  # [1, Hv, Dk, Dv]
    out = torch.empty_like(v)  # [T, Hv, Dv]
    for t in range(v.shape[0]):
        o, state = recurrent_step(
            state, q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1]
        )
        out[t] = o[0]
    return out, state[0]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in chunks; same arguments and results as ``recurrent_gated_delta_rule``."""
    q, k, v, g, beta = prepare_qkv(q, k, v, g, beta, use_qk_l2norm)
    num_chunks = -(-v.shape[0] // chunk_size)
    padded_rows = torch.arange(num_chunks * chunk_size, device=v.device)  # [N*C]
    chunk_token = padded_rows.clamp(max=v.shape[0] - 1)  # here chunk row t is token t
    source_rows = token_rows(chunk_token, v.shape[1], chunk_size)
    pad_rows = chunk_rows(padded_rows[v.shape[0] :], v.shape[1], chunk_size)
    packed = (pack_chunks(t, source_rows, pad_rows, chunk_size) for t in (q, k, v, g, beta))
    state = _initial(initial_state, v, k)[None]  # [1, Hv, Dk, Dv]
    out, state = chunk_scan(chunk_terms(*packed), state, (1,) * num_chunks)
    return out.transpose(1, 2).flatten(0, 1)[: v.shape[0]], state[0]
