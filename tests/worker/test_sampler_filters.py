"""Sampling filters at working values (top-p 0.9, top-k 20, min-p 0.1, with temperature and
combined) draw from the distribution an independent NumPy reference computes, in ONE batch that
mixes rows with different parameters (and a greedy row).

The check is Pearson's chi-square goodness-of-fit test per row on N draws, with cells of small
expected count merged. Its false-alarm rate (a correct sampler failing on an unlucky seed) is
ALPHA overall: each of the R rows is tested at ALPHA / R (Bonferroni). Tokens the reference
excludes must never be drawn at all. The seed is fixed, so the test is deterministic; ALPHA says
how unlikely a failure of a correct sampler would be for a seed picked at random. A wrong filter
order or off-by-one at the nucleus edge moves mass by several percent of a cell and fails by
orders of magnitude (see ``test_the_check_has_power``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.sampling_reference import reference_probs
from qwenserve.sampling_params import SamplingParams
from qwenserve.worker.sampler import SamplingRow, sample

VOCAB = 96
DRAWS = 6000  # per row
ALPHA = 1e-3
ROWS = [
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.0, top_k=20),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.7, top_k=20, top_p=0.9),
    dict(temperature=1.3, min_p=0.1, top_p=0.9),
    dict(temperature=0.8),
]


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test; cells expected below 5 draws are merged into one (the usual rule)."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    # survival function of chi2(dof): the regularised upper incomplete gamma Q(dof/2, stat/2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    """Logits falling by 0.08 per rank (probabilities in ratio ~0.92 at temperature 1), with a
    little noise and the token order shuffled per row. Each filter then cuts a real tail, and
    the combinations differ from each filter alone: at temperature 0.7, top-k 20 then top-p
    0.9 keeps ~15 tokens where either alone keeps 20-21 (top-p over the top-k renormalised)."""
    gen = torch.Generator().manual_seed(0)
    base = -0.08 * torch.arange(VOCAB, dtype=torch.float32)
    rows = [(base + 0.02 * torch.randn(VOCAB, generator=gen))[torch.randperm(VOCAB, generator=gen)]
            for _ in ROWS]
    return torch.stack(rows)  # [R, V]


@pytest.fixture(scope="module", params=["torch", "native"])
def kernel(request):
    """The PyTorch draw, and the platform's native one (csrc/sampling.cpp) where it builds."""
    if request.param == "torch":
        return None
    from qwenserve.native.sampling import sampling

    native = sampling()
    if native is None:
        pytest.skip("native sampling kernel not built here (no compiler or QWENSERVE_NATIVE=0)")
    return native


@pytest.fixture(scope="module")
def counts(logits, kernel) -> np.ndarray:
    """Draw counts [R, V] from DRAWS mixed batches, each row once per batch, plus a greedy row."""
    params = [SamplingParams(max_tokens=1, **p) for p in ROWS] + [SamplingParams(temperature=0)]
    rows = [SamplingRow(sp, [1], [], None) for sp in params]
    batch = torch.cat([logits, logits[:1]])  # the greedy row sees row 0's logits
    gen = torch.Generator().manual_seed(1234)
    draws = np.zeros((len(ROWS), VOCAB), dtype=np.int64)
    # one call with DRAWS copies of the mixed batch: rows of different parameters side by side
    tiled = batch.repeat(DRAWS, 1)
    tokens = [t.token_id for t in sample(tiled, rows * DRAWS, default_generator=gen,
                                          kernel=kernel)]
    per_batch = np.array(tokens).reshape(DRAWS, len(params))
    assert (per_batch[:, -1] == int(logits[0].argmax())).all()  # greedy row: always the argmax
    for r in range(len(ROWS)):
        np.add.at(draws[r], per_batch[:, r], 1)
    return draws


@pytest.mark.parametrize("row", range(len(ROWS)), ids=[str(p) for p in ROWS])
def test_draws_follow_the_reference_distribution(logits, counts, row):
    probs = reference_probs(logits[row].numpy(), ROWS[row])
    assert counts[row][probs == 0].sum() == 0, "drew a token the filters exclude"
    assert chi_square_p_value(counts[row], probs) > ALPHA / len(ROWS)


def test_the_filters_cut_at_these_values(logits):
    """The fixture is not degenerate: each filter removes tokens and leaves many, the combined
    rows keep fewer than their filters alone, and no token sits within float32 rounding of a
    cut (so float32 sampling and the float64 reference agree on the support)."""
    z = logits.numpy()
    kept = [int((reference_probs(z[r], p) > 0).sum()) for r, p in enumerate(ROWS)]
    assert all(10 <= k < VOCAB for k in kept[:5]), kept
    alone = [int((reference_probs(z[3], dict(temperature=0.7, **f)) > 0).sum())
             for f in (dict(top_k=20), dict(top_p=0.9))]
    assert kept[3] < min(alone), (kept[3], alone)
    for r, p in enumerate(ROWS):
        probs = np.exp(z[r] / p["temperature"] - (z[r] / p["temperature"]).max())
        probs /= probs.sum()
        if p.get("min_p"):
            assert np.abs(probs / probs.max() - p["min_p"]).min() > 1e-3
        if p.get("top_p"):
            support = reference_probs(z[r], {k: v for k, v in p.items() if k != "top_p"})
            mass = np.cumsum(np.sort(support)[::-1])
            assert np.abs(mass - p["top_p"]).min() > 1e-3


def test_the_check_has_power(logits, counts):
    """The same draws against slightly wrong references are rejected: top-p 0.88 instead of
    0.9, top-k 19 instead of 20, min-p 0.12 instead of 0.1, top-k 21 under top-p."""
    z = logits.numpy()
    wrong = [
        (0, dict(temperature=1.0, top_p=0.88)),
        (1, dict(temperature=1.0, top_k=19)),
        (2, dict(temperature=1.0, min_p=0.12)),
        (3, dict(temperature=0.7, top_k=21, top_p=0.9)),
    ]
    for row, p in wrong:
        probs = reference_probs(z[row], p)
        assert not np.array_equal(probs > 0, reference_probs(z[row], ROWS[row]) > 0), p
        impossible = counts[row][probs == 0].sum() > 0
        assert impossible or chi_square_p_value(counts[row], probs) < ALPHA / len(ROWS), p


@pytest.mark.parametrize("params", [dict(temperature=1.0, top_p=0.5),
                                    dict(temperature=0.9, min_p=0.05, top_p=0.7)],
                         ids=["top_p", "min_p+top_p"])
def test_top_p_cut_through_tied_logits(kernel, params):
    """A wide row whose logits come in 16 tied levels of 128 tokens (shuffled), top_p cutting
    through a level: the reference keeps that level's lowest token ids first (a stable sort),
    and so must the draw. The native kernel finds the nucleus through a histogram of the logits
    (a whole level in one bin): this is its edge bin holding many tied entries."""
    levels, per_level = 16, 128
    vocab = levels * per_level
    gen = torch.Generator().manual_seed(5)
    row = (-0.25 * torch.arange(levels).repeat_interleave(per_level))[torch.randperm(vocab,
                                                                                  generator=gen)]
    probs = reference_probs(row.numpy(), params)
    kept = probs > 0
    level_kept = [int(kept[row.numpy() == -0.25 * k].sum()) for k in range(levels)]
    assert any(0 < n < per_level for n in level_kept), level_kept  # the cut splits a level
    draws = 8_000
    sp = SamplingParams(max_tokens=1, **params)
    tokens = [t.token_id for t in sample(row[None].repeat(draws, 1),
                                          [SamplingRow(sp, [1], [], None)] * draws,
                                          default_generator=torch.Generator().manual_seed(9),
                                          kernel=kernel)]
    counts = np.bincount(np.array(tokens), minlength=vocab)
    assert counts[~kept].sum() == 0, "drew a token the filters exclude"
    assert chi_square_p_value(counts, probs) > ALPHA
