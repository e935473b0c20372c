"""Varlen attention equals dense attention under a block-diagonal mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwenserve.layers.varlen_attention import sdpa_varlen_attention, segments_by_length


def dense_block_diagonal(q, k, v, cu_seqlens, scale):
    n = q.shape[0]
    segment = torch.zeros(n, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        segment[a:b] = i
    mask = segment[:, None] == segment[None, :]  # [N, N]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("cu_seqlens", [
    [0, 7],
    [0, 4, 10, 14, 20, 20, 26],  # lengths 4 6 4 6 0 6: equal lengths apart, an empty one
    [0, 3, 6, 9, 12],  # all equal and adjacent: one call on a view
])
def test_matches_dense_masked_attention(cu_seqlens):
    gen = torch.Generator().manual_seed(0)
    n = cu_seqlens[-1]
    q, k, v = (torch.randn(n, 3, 8, generator=gen) for _ in range(3))
    got = sdpa_varlen_attention(q, k, v, cu_seqlens, 0.3)
    torch.testing.assert_close(got, dense_block_diagonal(q, k, v, cu_seqlens, 0.3),
                               rtol=1e-5, atol=1e-6)


def test_segments_group_by_length():
    assert segments_by_length([0, 4, 10, 14, 20, 20, 26]) == {4: [0, 10], 6: [4, 14, 20]}


def test_cu_seqlens_must_cover_the_tokens():
    q = torch.zeros(5, 1, 4)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to 5"):
        sdpa_varlen_attention(q, q, q, [0, 4], 1.0)
