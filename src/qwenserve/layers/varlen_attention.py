"""Bidirectional attention over packed sequences of different lengths (vision encoders).

Several images (and the frames of a video) are packed into one ``[N, H, D]`` tensor; segment
``i`` is rows ``[cu_seqlens[i], cu_seqlens[i + 1])`` and attends only to itself, so the
attention matrix is block-diagonal:

    cu_seqlens = [0, 4, 10, 14]      rows 0-3 | rows 4-9 | rows 10-13
                                     ████
                                         ██████
                                               ████

No segment is padded to the longest one: segments of equal length (same-size images, a video's
frames) run as one batched SDPA call, each distinct length as its own call. This is the CPU path
and the reference for a fused varlen kernel (flash-attn ``varlen_func``, torch_npu) behind the
same signature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

# (q, k, v, cu_seqlens, scale) -> out; q, k, v and out are [N, H, D]
VarlenAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[int], float],
                           torch.Tensor]


def segments_by_length(cu_seqlens: Sequence[int]) -> dict[int, list[int]]:
    """Segment start offsets grouped by segment length (zero-length segments dropped)."""
    groups: dict[int, list[int]] = {}
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if end > start:
            groups.setdefault(end - start, []).append(start)
    return groups


def sdpa_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens: Sequence[int], scale: float) -> torch.Tensor:
    """Block-diagonal attention by ``cu_seqlens`` with ``F.scaled_dot_product_attention``."""
    num_tokens, num_heads, head_dim = q.shape
    if list(cu_seqlens[:1]) != [0] or cu_seqlens[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to {num_tokens}, got {list(cu_seqlens)}")
    out = torch.empty_like(q)
    for length, starts in segments_by_length(cu_seqlens).items():
        rows = _rows(starts, length, q.device)
        shape = (len(starts), length, num_heads, head_dim)
        qs, ks, vs = (t[rows].reshape(shape).transpose(1, 2) for t in (q, k, v))  # [B,H,L,D]
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out[rows] = o.transpose(1, 2).reshape(-1, num_heads, head_dim)
    return out


def _rows(starts: list[int], length: int, device: torch.device) -> torch.Tensor | slice:
    """The packed rows of equal-length segments: a slice when they are adjacent."""
    if all(b - a == length for a, b in zip(starts, starts[1:])):
        return slice(starts[0], starts[0] + length * len(starts))
    offsets = torch.arange(length, device=device)
    return torch.cat([offsets + s for s in starts])
