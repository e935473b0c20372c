"""The gated RMSNorm that closes a Gated DeltaNet layer (HF ``Qwen3_5RMSNormGated``).

Norm before gate, per head over Dv, with the PLAIN weight convention (``w * x_hat``, HF inits w to
ones), unlike the zero-centred ``(1 + w)`` norms elsewhere in Qwen3.5 (qwen_arch.md §3.6).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from qwenserve.layers.recurrent.base import RecurrentBackend


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """``w * rmsnorm(x) * silu(gate)``: x, gate [..., Dv], weight [Dv]; returns x's dtype.

    Rounding follows HF exactly: the normalised value is cast to x's dtype before the weight
    multiply, the gate is applied in fp32, and the result is cast once at the end.
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(dtype)
    return (y * F.silu(gate.float())).to(dtype)


class RMSNormGated(nn.Module):
    """Module form; ``weight`` [Dv] is shared by all value heads (``linear_attn.norm.weight``).
    With a recurrent ``backend`` its (possibly fused) ``gated_rms_norm`` runs it."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None,
                 backend: RecurrentBackend | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))  # [Dv]
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [num_tokens, Hv, Dv] (gate may be a strided view) -> x's shape."""
        if self.backend is not None:
            return self.backend.gated_rms_norm(x, gate, self.weight, self.eps)
        return rms_norm_gated(x, gate, self.weight, self.eps)
