"""The verifying sampler keeps the target distribution: chi-square tests with fixed seeds.

Each test compares observed counts of emitted tokens with the target distribution. The
tests are deterministic (fixed generator seeds); with correct code a fresh seed would fail
a single comparison with probability ALPHA = 1e-4, the stated false-alarm rate.
"""

from __future__ import annotations

import torch

from qwenserve.sampling_params import SamplingParams
from qwenserve.spec_decode.rejection import accept_greedy, rejection_sample, verify
from qwenserve.worker.sampler import SamplingRow, probabilities, process_logits, sample

ALPHA = 1e-4
V = 6


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi2 >= observed) for counts against probs (cells with expected > 0)."""
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         stat.double() / 2))


def test_accept_greedy():
    assert accept_greedy([4, 5, 6], [4, 5]) == [4, 5, 6]
    assert accept_greedy([4, 7, 6], [4, 5]) == [4, 7]
    assert accept_greedy([1, 7, 6], [4, 5]) == [1]
    assert accept_greedy([3], []) == [3]


def _draws(p: torch.Tensor, draft: list[int] | None, q: torch.Tensor | None, n: int,
           seed: int) -> list[list[int]]:
    """n runs; ``draft`` None: each run's drafts are drawn from q, as a drafter draws them."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(n):
        d = draft if draft is not None else torch.multinomial(q, 1, generator=g)[:, 0].tolist()
        outs.append(rejection_sample(p, d, q, g))
    return outs


def _check(p: torch.Tensor, outs: list[list[int]]) -> None:
    first = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=V).double()
    assert chi_square_p_value(first, p[0].double()) > ALPHA
    # Once the first draft is accepted, the second token follows p[1]; and so on.
    second = [o[1] for o in outs if len(o) > 1]
    assert len(second) > 1000
    counts = torch.bincount(torch.tensor(second), minlength=V).double()
    assert chi_square_p_value(counts, p[1].double()) > ALPHA


def test_one_hot_drafts_keep_the_target_distribution():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(3, V) * 1.5, dim=-1)
    draft = [int(p[0].argmax()), 2]  # a likely first draft, an arbitrary second
    outs = _draws(p, draft, None, 12000, seed=1)
    _check(p, outs)
    assert all(1 <= len(o) <= 3 for o in outs)


def test_drafts_with_a_distribution_keep_the_target_distribution():
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(3, V), dim=-1)
    q = torch.softmax(torch.randn(2, V), dim=-1)
    outs = _draws(p, None, q, 12000, seed=2)
    _check(p, outs)


def test_a_bad_chi_square_is_detected():
    """The test has power: sampling from the draft instead of the target fails it."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(V) * 1.5, dim=-1)
    wrong = torch.softmax(torch.randn(V) * 1.5, dim=-1)
    g = torch.Generator().manual_seed(3)
    counts = torch.bincount(torch.multinomial(wrong, 12000, replacement=True, generator=g),
                            minlength=V).double()
    assert chi_square_p_value(counts, p.double()) < ALPHA


def test_verify_matches_the_non_speculative_sampler():
    """verify() with drafts emits the first token as sample() draws it: same processed
    distribution (temperature, top_k, penalties), compared to sample()'s own draws."""
    torch.manual_seed(2)
    n = 3000
    params = SamplingParams(temperature=0.8, top_k=4, repetition_penalty=1.3, max_tokens=8)
    logits_one = torch.randn(3, V) * 2
    draft = [int(logits_one[0].argmax()), 1]
    rows, drafts = [], []
    for _ in range(n):
        rows += [SamplingRow(params, [0, 1], [2] + draft[:j], None) for j in range(3)]
        drafts.append(draft)
    g = torch.Generator().manual_seed(5)
    out = verify(logits_one.repeat(n, 1), rows, drafts, g)
    first = torch.bincount(torch.tensor([o[0].token_id for o in out]), minlength=V).double()
    plain_rows = [SamplingRow(params, [0, 1], [2], None)] * n
    ref = sample(logits_one[:1].repeat(n, 1), plain_rows, torch.Generator().manual_seed(6))
    ref_counts = torch.bincount(torch.tensor([t.token_id for t in ref]), minlength=V).double()
    _, processed = process_logits(logits_one[:1], plain_rows[:1])
    expected = probabilities(processed, [params])[0].double()
    assert chi_square_p_value(first, expected) > ALPHA
    assert chi_square_p_value(ref_counts, expected) > ALPHA
    # Penalties see the drafts: row 1's history holds draft[0], so it is penalised there.
    second = [o[1].token_id for o in out if len(o) > 1 and o[0].token_id == draft[0]]
    _, processed = process_logits(logits_one[1:2], [rows[1]])
    expected = probabilities(processed, [params])[0].double()
    counts = torch.bincount(torch.tensor(second), minlength=V).double()
    assert chi_square_p_value(counts, expected) > ALPHA


def test_verify_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 3, 1, 0, 0, 0], [0, 0, 0, 4, 0, 0], [5.0, 0, 0, 0, 0, 0]])
    params = SamplingParams(temperature=0, logprobs=2, max_tokens=8)
    rows = [SamplingRow(params, [0], [], None) for _ in range(3)]
    out = verify(logits, rows, [[1, 3]])[0]
    assert [t.token_id for t in out] == [1, 3, 0]
    lp = torch.log_softmax(logits, dim=-1)
    assert [round(t.logprob, 5) for t in out] == [round(float(lp[i, t.token_id]), 5)
                                                  for i, t in enumerate(out)]
    assert out[0].rank == 1 and len(out[0].top_logprobs) == 2
    out = verify(logits, rows, [[2, 3]])[0]
    assert [t.token_id for t in out] == [1]
