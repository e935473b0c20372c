"""The gated delta rule in fp32: the one-token recurrence and the chunked (parallel) form.

Per value head, with S in R^{Dk x Dv} (qwen_arch.md §3.4):

    S_t = exp(g_t) * S_{t-1};  S_t += k_t (beta_t * (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t

The chunked form (§3.5; HF ``torch_chunk_gated_delta_rule``, fla ``chunk_gated_delta_rule``)
solves each chunk of C tokens with a unit-lower-triangular system, then scans over chunks. Its
per-chunk terms are built for every chunk of every request in one batch; only the scan is serial.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: FLA's use_qk_l2norm_in_kernel convention."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


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
        q, k = l2norm(q), l2norm(k)
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
    """One token for N independent sequences: state [N, H, Dk, Dv], q/k [N, H, Dk], v [N, H, Dv],
    g/beta [N, H] (prepared) -> (o [N, H, Dv], new state)."""
    state = state * g.exp()[..., None, None]
    kv_mem = torch.einsum("nhkv,nhk->nhv", state, k)  # [N, H, Dv]: what S already predicts
    delta = (v - kv_mem) * beta[..., None]  # [N, H, Dv]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("nhkv,nhk->nhv", state, q), state


@dataclass(frozen=True)
class ChunkTerms:
    """Everything the chunk scan needs, per chunk n and head h (γ = cumsum of g in the chunk)."""

    u: torch.Tensor  # [N, H, C, Dv]  A^{-1} (beta v)              "new values"
    w: torch.Tensor  # [N, H, C, Dk]  A^{-1} (beta exp(γ) k)       reads the incoming state
    attn: torch.Tensor  # [N, H, C, C]   (q k^T) ⊙ exp(γ_i - γ_j), j <= i
    q_dec: torch.Tensor  # [N, H, C, Dk] exp(γ) q
    k_dec: torch.Tensor  # [N, H, C, Dk] exp(γ_C - γ) k
    chunk_decay: torch.Tensor  # [N, H]   exp(γ_C)


def chunk_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int,
) -> ChunkTerms:
    """Intra-chunk terms for rows laid out as whole chunks: q/k [N*C, H, Dk], v [N*C, H, Dv],
    g/beta [N*C, H] (prepared; padding rows all zero, so beta = g = 0 keeps them inert)."""

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [N*C, H, ...] -> contiguous [N, H, C, ...]
        return t.reshape(-1, chunk_size, *t.shape[1:]).transpose(1, 2).contiguous()

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    gamma = g.cumsum(dim=-1)  # [N, H, C]
    gamma_exp = gamma.exp()  # [N, H, C]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # exp(γ_i - γ_j) for j <= i; -inf above the diagonal so exp() cannot overflow there
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]  # [N, H, C, Dk]
    # A = I + strict_lower(beta_i k_i.k_j Γ_ij); unitriangular=True ignores the diagonal. The
    # explicit inverse (as fla does) turns the two solves into matmuls: faster on every device.
    system = (k_beta @ k.mT) * decay  # [N, H, C, C]
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device).expand_as(system)
    inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    return ChunkTerms(
        u=inverse @ (v * beta[..., None]),
        w=inverse @ (k_beta * gamma_exp[..., None]),
        attn=(q @ k.mT) * decay,
        q_dec=q * gamma_exp[..., None],
        k_dec=k * (gamma[..., -1:] - gamma).exp()[..., None],
        chunk_decay=gamma_exp[..., -1],
    )


def chunk_scan(
    terms: ChunkTerms, states: torch.Tensor, active_per_step: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry each request's state across its chunks, all requests together.

    Requests are sorted longest first and chunks laid out step-major (``GDNMetadata``), so at
    step i the running requests are the first ``active_per_step[i]`` and their chunks one
    contiguous block. states [R, H, Dk, Dv] -> (o [N*C, H, Dv] in the chunk layout, final states).
    """
    num_chunks, heads, chunk_size, dv = terms.u.shape
    out = terms.u.new_empty(num_chunks, heads, chunk_size, dv)  # [N, H, C, Dv]
    first = 0
    for num_active in active_per_step:
        block = slice(first, first + num_active)  # this step's chunk of each running request
        first += num_active
        s = states[:num_active]  # [n, H, Dk, Dv]
        v_new = terms.u[block] - terms.w[block] @ s  # [n, H, C, Dv]: the delta-rule correction
        out[block] = terms.q_dec[block] @ s + terms.attn[block] @ v_new
        decayed = s * terms.chunk_decay[block][..., None, None]
        states[:num_active] = decayed + terms.k_dec[block].mT @ v_new
    return out.transpose(1, 2).reshape(-1, heads, dv), states


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
    length = v.shape[0]
    num_chunks = -(-length // chunk_size)
    padded = []
    for t in (q, k, v, g, beta):
        p = t.new_zeros(num_chunks * chunk_size, *t.shape[1:])  # [N*C, ...]
        p[:length] = t
        padded.append(p)
    terms = chunk_terms(*padded, chunk_size=chunk_size)
    state = _initial(initial_state, v, k)[None]  # [1, Hv, Dk, Dv]
    out, state = chunk_scan(terms, state, (1,) * num_chunks)
    return out[:length], state[0]
