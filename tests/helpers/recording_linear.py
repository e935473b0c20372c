"""A linear function that counts its calls: which route a wrapped platform GEMM took."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RecordingLinear:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        return F.linear(x, weight, bias)
