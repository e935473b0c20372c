"""Rotary position embedding (the NeoX "rotate_half" form), with partial rotary dims.

cos/sin are precomputed once for every position in fp32 exactly as HF computes them
(``pos * inv_freq``), then indexed per token, so results match HF bit for bit in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from qwenserve.layers.backends import ElementwiseKernels

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: PretrainedConfig) -> tuple[str, float]:
    """(rope_type, rope_theta) from a v5 ``rope_parameters`` or v4 ``rope_theta``/``rope_scaling``."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return rope_type or "default", float(theta if theta is not None else 10000.0)


def _inv_freq(config: PretrainedConfig, rotary_dim: int) -> tuple[torch.Tensor, float]:
    rope_type, theta = rope_parameters(config)
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: "
                         f"{', '.join(_STATIC_ROPE_TYPES)}")
    if rope_type == "default":
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (theta**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    target = torch.empty(0).device  # the device the model is being built on (meta in `plan`)
    with torch.device("cpu"):  # HF's init mixes default-device and "cpu" tensors
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float().to(target), float(scaling)


class RotaryEmbedding(nn.Module):
    """With the platform's fused ``kernels``, ``forward`` rotates q and k in place (the caller
    owns them: views of the fresh qkv projection) and returns them; otherwise it returns new
    tensors from the PyTorch reference. The results are the same, bit for bit."""

    def __init__(self, config: PretrainedConfig, head_dim: int, rotary_dim: int, max_position: int,
                 kernels: ElementwiseKernels | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.kernels = kernels
        inv_freq, scaling = _inv_freq(config, rotary_dim)
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, rotary_dim]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D]: rotate the first ``rotary_dim`` dims of each head."""
        if (self.kernels is not None and self.kernels.supports(q) and positions.dim() == 1
                and all(t.stride(1) == t.shape[2] and t.stride(2) == 1 for t in (q, k))):
            self.kernels.rotary(positions, q, k, self.cos, self.sin, self.rotary_dim)
            return q, k
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, rotary_dim]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)
