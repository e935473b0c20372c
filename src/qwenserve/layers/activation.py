"""SwiGLU activation on a merged [gate | up] projection."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from qwenserve.layers.backends import ElementwiseKernels


def silu_and_mul(x: torch.Tensor, kernels: ElementwiseKernels | None = None) -> torch.Tensor:
    """[..., 2*I] (gate then up) -> silu(gate) * up, [..., I]: in one pass with the platform's
    fused ``kernels`` where they support x, else the PyTorch reference below."""
    if kernels is not None and kernels.supports(x):
        return kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    # a contiguous gate and in-place ops: half the time of F.silu(gate) * up on CPU
    return F.silu(gate.contiguous(), inplace=True).mul_(up)
