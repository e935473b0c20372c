"""RMSNorm in the two conventions Qwen models use (see research/qwen_arch.md §0)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from qwenserve.layers.backends import ElementwiseKernels


class RMSNorm(nn.Module):
    """Plain RMSNorm (Llama, Qwen2, Qwen3): ``w * (x / rms(x)).to(dtype)``, statistics in fp32.

    ``forward(x, residual)`` first adds the residual (in the activation dtype, as HF does) and
    returns ``(normed, new_residual)``, which saves one pass over the hidden states per layer.
    With the platform's fused ``kernels`` the add and the norm are one pass (same roundings);
    the PyTorch code below is the reference and runs for what the kernels do not support.
    """

    zero_centred = False

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 kernels: ElementwiseKernels | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.kernels = kernels

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.kernels is not None and self.kernels.supports(x):
            normed, new_residual = self.kernels.rms_norm(x, residual, self.weight, self.eps,
                                                         self.zero_centred)
            return normed if residual is None else (normed, new_residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3.5 / Qwen3-Next: ``(x / rms(x) * (1 + w))`` computed in fp32; stored w is around 0."""

    zero_centred = True

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 kernels: ElementwiseKernels | None = None) -> None:
        super().__init__(hidden_size, eps, dtype, kernels)
        nn.init.zeros_(self.weight)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
