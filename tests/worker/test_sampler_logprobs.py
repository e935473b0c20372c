"""The log-probabilities a response reports, computed per row for the tokens asked (the native
kernel on CPU, reading the raw logits in place) against ``torch.log_softmax`` of the float32
rows: the chosen token's logprob and rank, and the top entries, for fp32 and bf16 logits."""

from __future__ import annotations

import pytest
import torch

from qwenserve.worker.sampler import Logprobs


@pytest.fixture(scope="module")
def kernel():
    from qwenserve.native.kernels import sampling

    native = sampling()
    if native is None:
        pytest.skip("native sampling kernel not built here (no compiler or QWENSERVE_NATIVE=0)")
    return native


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
