"""``--load-format dummy``: random weights instead of a checkpoint, for benchmarks and tests that
need a model of a given shape but not its knowledge (vLLM's dummy format draws the same way:
uniform in [-1e-3, 1e-3], so activations stay finite through any depth)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int, low: float = -1e-3, high: float = 1e-3) -> None:
    """Fill every floating-point parameter of ``model`` in place, reproducibly from ``seed``."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for param in model.parameters():
        if param.is_floating_point():
            values = torch.empty(param.shape, dtype=torch.float32).uniform_(
                low, high, generator=generator)
            param.copy_(values.to(param.dtype))
