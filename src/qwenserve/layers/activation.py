"""Activations: SwiGLU on a merged [gate | up] projection, a sigmoid output gate."""

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


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor,
                 kernels: ElementwiseKernels | None = None) -> torch.Tensor:
    """x, gate [T, H, D] (heads may be strided views) -> x * sigmoid(gate) as [T, H * D]: Qwen3.5's
    gated attention output, in one pass with the platform's kernels where they support x."""
    if kernels is not None and kernels.supports(x) and kernels.supports(gate):
        return kernels.sigmoid_gate(x, gate)
    tokens = x.shape[0]
    return x.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1))
