"""Verify draft tokens against the target model's distributions: lossless by construction.

A request with k drafts contributes k + 1 rows of logits: row j is the target's distribution
after the drafts before j (its history includes them, so penalties, min_tokens and bad words see
what a non-speculative run would have seen).

    rows of one request:  p_0        p_1          ...  p_k
    given:                ctx        ctx + d_0         ctx + d_0..d_{k-1}
    verify d_j:           accept with probability min(1, p_j(d_j) / q_j(d_j));
                          on the first rejection draw from norm(max(0, p_j - q_j)) and stop;
    all k accepted:       draw the bonus token from p_k

This is the standard speculative-sampling scheme (Leviathan et al. 2023; Chen et al. 2023): each
emitted token is distributed exactly as p. Drafts from ngram lookup or greedy drafters are
deterministic, so q_j is one-hot at d_j: accept with probability p_j(d_j), resample from p_j
without d_j. Greedy requests accept while the draft equals the argmax, then emit the argmax.
"""

from __future__ import annotations

import torch

from qwenserve.core.sched_output import SampledToken
from qwenserve.layers.backends import SamplingKernel
from qwenserve.worker.sampler import SamplingRow, package, probabilities, process_logits


def verify(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]],
           default_generator: torch.Generator | None = None,
           bitmask: torch.Tensor | None = None,
           draft_probs: list[torch.Tensor | None] | None = None,
           kernel: SamplingKernel | None = None) -> list[list[SampledToken]]:
    """logits [sum(len(d) + 1), V]: each request's k + 1 rows in order (``rows`` likewise).
    Returns per request its accepted drafts followed by one new token (1 to k + 1 tokens).
    ``draft_probs[i]`` [k, V]: the drafter's distributions (None: deterministic drafts).
    ``kernel``: the platform's sampling kernel, for the logprobs a row asks for."""
    logprobs, processed = process_logits(logits, rows, bitmask, kernel)
    greedy_ids = processed.argmax(dim=-1).tolist()
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    probs = None
    if random_rows:
        probs = torch.zeros_like(processed)
        probs[random_rows] = probabilities(processed[random_rows],
                                           [rows[i].params for i in random_rows])
    out, first = [], 0
    for i, draft in enumerate(drafts):
        last = first + len(draft)
        row = rows[first]
        if row.params.greedy:
            token_ids = accept_greedy(greedy_ids[first : last + 1], draft)
        else:
            q = None if draft_probs is None else draft_probs[i]
            token_ids = rejection_sample(probs[first : last + 1], draft, q,
                                         row.generator or default_generator)
        n = len(token_ids)
        out.append(package(torch.tensor(token_ids), None if logprobs is None
                           else logprobs[first : first + n], rows[first : first + n]))
        first = last + 1
    return out


def accept_greedy(target_ids: list[int], draft: list[int]) -> list[int]:
    """target_ids: the argmax of each of the k + 1 rows -> the tokens greedy decoding emits."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target_ids[accepted]:
        accepted += 1
    return target_ids[: accepted + 1]


def rejection_sample(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """p [k + 1, V] target probabilities, q [k, V] draft probabilities (None: one-hot)."""
    for j, token in enumerate(draft):
        p_tok = p[j, token].item()
        q_tok = 1.0 if q is None else q[j, token].item()
        u = torch.rand((), generator=generator, device=p.device).item()
        if u * q_tok < p_tok:  # u < p/q without dividing by a zero q
            continue
        if q is None:
            residual = p[j].clone()
            residual[token] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_(min=0.0)
        if not residual.sum().item() > 0:  # only by rounding: p == q
            residual = p[j]
        return draft[:j] + [_draw(residual, generator)]
    return draft + [_draw(p[len(draft)], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalised weights: the exponential race ``argmax(w / E)``, as the
    sampler draws."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax().item())
