"""SwiGLU activation on a merged [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2*I] (gate then up) -> silu(gate) * up, [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    # a contiguous gate and in-place ops: half the time of F.silu(gate) * up on CPU
    return F.silu(gate.contiguous(), inplace=True).mul_(up)
