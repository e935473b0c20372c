"""The structured-output token bitmask on the logits: a token whose bit is clear gets -inf, the
others keep their value, rows whose words are all set are untouched. CPU float32 logits take
xgrammar's CPU kernel; other dtypes the torch unpacking; both against a NumPy reading of the
bits, with a vocabulary that ends mid-word."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwenserve.worker.sampler import apply_token_bitmask


def reference(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return np.where(bits.astype(bool), logits, -np.inf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bitmask_sets_the_cleared_tokens_to_minus_inf(dtype):
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 1000, 6  # 1,000 = 31 words and 8 bits
    words = (vocab + 31) // 32
    logits = torch.randn(rows, vocab, generator=gen, dtype=dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen, dtype=torch.int32)
    bitmask[[1, 4]] = -1  # unconstrained rows
    expected = reference(logits.numpy(), bitmask.numpy())
    apply_token_bitmask(logits, bitmask)
    np.testing.assert_array_equal(logits.numpy(), expected)
    assert torch.isinf(logits[0]).any() and not torch.isinf(logits[1]).any()
