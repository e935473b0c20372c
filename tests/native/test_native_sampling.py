"""The native draw (csrc/sampling.cpp) against exact references, at a real vocabulary's width.

An inverse-CDF draw maps u in [0, 1) onto the tokens in order of their mass, so a grid of N
evenly spaced u values must hit each token a number of times within one of N * p (plus float
rounding): an exact, deterministic check of the whole distribution, truncations included, at
widths (thousands of tokens) where N random draws could not tell.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.sampling_reference import reference_probs
from qwenserve.native.sampling import sampling
from qwenserve.worker.sampler import Logprobs

GRID = 2000


@pytest.fixture(scope="module")
def kernel():
    native = sampling()
    if native is None:
        pytest.skip("native sampling kernel not built here (no compiler or QWENSERVE_NATIVE=0)")
    return native


def draw(kernel, logits: torch.Tensor, u: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0,
         min_p=0.0) -> np.ndarray:
    """One draw per u, all on the same row of logits."""
    rows = logits.expand(len(u), -1)
    n = len(u)
    return kernel.draw(rows, [temperature] * n, [top_k] * n, [top_p] * n, [min_p] * n,
                       u).numpy()


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.6, top_k=20, top_p=0.95),  # Qwen3's generation_config
    dict(temperature=0.7, top_k=200),
    dict(temperature=1.0, top_p=0.8),  # top_p alone over a flat row: several candidate rounds
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=1.3, min_p=0.02, top_p=0.9),
]


def row_of_logits(shape: str, vocab: int) -> torch.Tensor:
    """flat: every token within a few nats; peaked: spread over tens of nats; two-level: ten
    tokens 9 nats above the rest, holding ~80% of the mass, so a top_p of 0.9 reaches into the
    low level (the candidate search's second round)."""
    gen = torch.Generator().manual_seed(7)
    if shape == "two-level":
        logits = -9.0 + 0.1 * torch.randn(1, vocab, generator=gen)
        logits[0, torch.randperm(vocab, generator=gen)[:10]] = 0.0
    else:
        logits = (0.3 if shape == "flat" else 4.0) * torch.randn(1, vocab, generator=gen)
    logits[0, 123] = -float("inf")  # a masked token is never drawn
    return logits


GRID_CASES = [(shape, case) for shape in ("flat", "peaked") for case in CASES]
GRID_CASES.append(("two-level", dict(temperature=1.0, top_p=0.9)))


@pytest.mark.parametrize(("shape", "case"), GRID_CASES,
                         ids=[f"{shape}-{case}" for shape, case in GRID_CASES])
def test_a_grid_of_uniforms_reproduces_the_distribution(kernel, case, shape):
    vocab = 8_000
    logits = row_of_logits(shape, vocab)
    u = (torch.arange(GRID, dtype=torch.float64) + 0.5) / GRID
    counts = np.bincount(draw(kernel, logits, u, **case), minlength=vocab)
    probs = reference_probs(logits[0].numpy(), {"temperature": 1.0, **case})
    assert counts[probs == 0].sum() == 0, "drew a token the filters exclude"
    # each token's share of the grid within 1 draw of N * p, up to float rounding of the mass
    assert np.abs(counts - GRID * probs).max() <= 1.0 + GRID * 1e-4


def test_greedy_is_torch_argmax_with_masks_and_ties(kernel):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 151_936, generator=gen)
    logits[1, ::2] = -float("inf")
    logits[2, 100] = logits[2, 5000] = 50.0  # a tie: the first index, as torch
    logits[3] = -float("inf")  # everything masked: index 0, as torch
    n = logits.shape[0]
    out = kernel.draw(logits, [0.0] * n, [0] * n, [1.0] * n, [0.0] * n,
                      torch.zeros(n, dtype=torch.float64))
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_rows_keep_their_own_parameters_and_strides(kernel):
    """A batch mixing greedy and random rows, read through a strided view (the LM head's rows
    of a wider buffer), equals each row drawn alone."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 1200, generator=gen)
    logits = wide[:, :1000]
    params = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.6, 20, 0.95, 0.0), (1.0, 0, 0.5, 0.0),
              (0.9, 0, 1.0, 0.1), (0.0, 0, 1.0, 0.0)]
    u = torch.rand(6, dtype=torch.float64, generator=gen)
    together = kernel.draw(logits, *[list(p) for p in zip(*params)], u)
    alone = [kernel.draw(logits[i:i + 1].contiguous(), *[[v] for v in params[i]], u[i:i + 1])
             for i in range(6)]
    assert together.tolist() == [int(a) for a in alone]


def test_the_sampler_uses_it_with_seeded_generators(kernel):
    """Through ``sample``: a seeded request draws the same tokens whatever else is in the batch."""
    from qwenserve.sampling_params import SamplingParams
    from qwenserve.worker.sampler import SamplingRow, sample

    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1))

    def seeded_draws(batch_rows: int) -> list[int]:
        out = []
        gen = torch.Generator().manual_seed(42)
        for _ in range(20):
            rows = [SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), [1], [], gen)]
            rows += [SamplingRow(SamplingParams(temperature=0.8), [1], [], None)
                     for _ in range(batch_rows - 1)]
            out.append(sample(logits[:batch_rows], rows, kernel=kernel)[0].token_id)
        return out

    assert seeded_draws(1) == seeded_draws(4)


def test_bf16_logits_draw_as_their_float32_widening(kernel):
    """bf16 logits (the LM head's own dtype) are read in place and widened exactly: every
    draw, greedy or truncated, equals the draw from ``logits.float()``, strided rows included."""
    gen = torch.Generator().manual_seed(5)
    wide = (3.0 * torch.randn(7, 5000, generator=gen)).bfloat16()
    logits = wide[:, :4096]
    logits[1, ::3] = -float("inf")
    params = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.6, 20, 0.95, 0.0), (1.0, 0, 0.5, 0.0),
              (0.9, 0, 1.0, 0.1), (1.3, 0, 0.9, 0.02), (0.0, 0, 1.0, 0.0)]
    columns = [list(p) for p in zip(*params)]
    for _ in range(5):
        u = torch.rand(7, dtype=torch.float64, generator=gen)
        assert (kernel.draw(logits, *columns, u).tolist()
                == kernel.draw(logits.float(), *columns, u).tolist())


def test_the_sampler_takes_bf16_logits_as_float32(kernel):
    """Through ``sample``: bf16 logits give the tokens and logprobs of their float32 widening,
    with and without an edit (logit_bias), seeded and greedy rows alike."""
    from qwenserve.sampling_params import SamplingParams
    from qwenserve.worker.sampler import SamplingRow, sample

    logits = (2.0 * torch.randn(3, 3000, generator=torch.Generator().manual_seed(2))).bfloat16()
    params = [SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=1.0, top_p=0.9, seed=1),
              SamplingParams(temperature=0.8, logit_bias={5: 30.0}, logprobs=1)]

    def run(x: torch.Tensor, draw_kernel) -> list:
        rows = [SamplingRow(p, [1], [], torch.Generator().manual_seed(9)) for p in params]
        return [(t.token_id, t.logprob) for t in sample(x, rows, kernel=draw_kernel)]

    want = run(logits.float(), kernel)
    assert run(logits, kernel) == want
    assert want[2][0] == 5  # the bias edit applied
    assert [t for t, _ in run(logits, None)] == [t for t, _ in run(logits.float(), None)]


# The log-probabilities a response reports (worker/sampler.py's Logprobs): per row for the tokens
# asked, the kernel reading the raw logits in place, against torch.log_softmax of the float32 rows.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_logprobs_match_log_softmax(kernel, dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 5003, generator=gen) * 3).to(dtype)
    rows = [0, 2, 3, 6]
    tokens = [int(logits[0].argmax()), 17, 5002, int(logits[6].argsort()[2500])]
    chosen, ranks, tops = Logprobs(logits, kernel).of(rows, tokens, 5)
    ref = torch.log_softmax(logits[rows].float(), dim=-1)
    for j, (t, lp, rank, top) in enumerate(zip(tokens, chosen, ranks, tops, strict=True)):
        assert lp == pytest.approx(ref[j, t].item(), abs=2e-5)
        assert rank == int((logits[rows[j]] > logits[rows[j], t]).sum()) + 1
        values, ids = ref[j].topk(5)
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=2e-5)
        if dtype == torch.float32:  # no ties: the same ids in the same order
            assert [i for i, _ in top] == ids.tolist()
        else:  # bf16 ties: each listed id has the logprob listed for it
            assert all(abs(ref[j, i].item() - v) < 2e-5 for i, v in top)
    assert ranks[0] == 1


def test_fallback_and_kernel_agree_on_ranks_and_no_top(kernel):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 300, generator=gen)
    native = Logprobs(logits, kernel).of([0, 1, 2], [5, 6, 7], 0)
    fallback = Logprobs(logits, None).of([0, 1, 2], [5, 6, 7], 0)
    assert native[1] == fallback[1] and native[2] == fallback[2] == [[], [], []]
    assert native[0] == pytest.approx(fallback[0], abs=2e-5)
