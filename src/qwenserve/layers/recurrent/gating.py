"""The Gated DeltaNet's gates from its a/b projections: the reference (``gdn_gating``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) from the a/b projections [num_tokens, Hv]: g = -exp(A_log) * softplus(a + dt_bias)
    (log decay, fp32: in fp16 exp(A_log) may overflow) and beta = sigmoid(b) (activation dtype)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)  # [num_tokens, Hv]
    return g, b.sigmoid()
