"""Repetition, frequency and presence penalties, applied to the (row, token) pairs each row has
seen, against the dense form (every row's counts over the whole vocabulary, as vLLM writes it),
value for value in fp32 and bf16: repeated tokens, negative logits, rows without penalties and
without history, and placeholder ids past the LM head's rows (which have no logit)."""

from __future__ import annotations

import random

import pytest
import torch

from qwenserve.sampling_params import SamplingParams
from qwenserve.worker.sampler import SamplingRow, _apply_penalties


def dense_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    out = logits.clone()
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if not p.has_penalties:
            continue
        counts = torch.zeros(vocab)
        for t in r.output_token_ids:
            if 0 <= t < vocab:
                counts[t] += 1
        seen = counts > 0
        for t in r.prompt_token_ids:
            if 0 <= t < vocab:
                seen[t] = True
        row = out[i]
        rep = torch.tensor(p.repetition_penalty, dtype=logits.dtype)
        row = torch.where(seen, torch.where(row > 0, row / rep, row * rep), row)
        row = (row - torch.tensor(p.frequency_penalty, dtype=logits.dtype) * counts).to(
            logits.dtype)
        row = row - torch.tensor(p.presence_penalty, dtype=logits.dtype) * (counts > 0)
        out[i] = row
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_penalties_equal_the_dense_form(dtype):
    rng = random.Random(0)
    torch.manual_seed(0)
    for _ in range(40):
        vocab, batch = rng.choice([64, 500]), rng.randint(1, 5)
        logits = (torch.randn(batch, vocab) * 4).to(dtype)
        rows = []
        for _ in range(batch):
            kw = {}
            if rng.random() < 0.7:
                kw["repetition_penalty"] = rng.choice([1.0, 1.05, 1.3, 0.8])
            if rng.random() < 0.5:
                kw["frequency_penalty"] = rng.uniform(-1, 1)
            if rng.random() < 0.5:
                kw["presence_penalty"] = rng.uniform(-1, 1)
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
            prompt += [vocab + 7] * rng.randint(0, 2)  # a placeholder past the LM head's rows
            output = [rng.randrange(min(vocab, 20)) for _ in range(rng.randint(0, 25))]
            rows.append(SamplingRow(SamplingParams(max_tokens=4, **kw), prompt, output, None))
        expected = dense_penalties(logits, rows)
        _apply_penalties(logits, rows)
        assert torch.equal(logits, expected)
