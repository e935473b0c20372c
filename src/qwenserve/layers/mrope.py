"""Multimodal rotary embedding (M-RoPE): each rotary frequency follows one of three position axes.

A token of a vision-language prompt has three positions, (temporal, height, width); text tokens
have the same value on all three. ``mrope_section = [s_t, s_h, s_w]`` (summing to rotary_dim / 2)
says how many frequencies each axis drives, in one of two layouts:

    interleaved (Qwen3-VL, Qwen3.5):  freq i -> H if i % 3 == 1 and i < 3 * s_h,
                                                W if i % 3 == 2 and i < 3 * s_w, else T
                                      e.g. [2, 1, 1]: T H W T T ...     (T fills the tail)
    chunked (Qwen2-VL, Qwen2.5-VL):   s_t frequencies of T, then s_h of H, then s_w of W

The cos/sin tables are the plain RoPE ones (``RotaryEmbedding``, fp32 ``pos * inv_freq``); M-RoPE
only picks, per frequency, which axis's position indexes the table, so a text-only batch (1-D
positions, or three equal rows) gives exactly plain RoPE.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from qwenserve.layers.rotary import RotaryEmbedding, rope_parameters

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from qwenserve.layers.backends import ElementwiseKernels


def mrope_layout(rope_params: dict, default_interleaved: bool) -> tuple[list[int], bool]:
    """``(mrope_section, interleaved)`` from a config's ``rope_parameters``/``rope_scaling``.

    HF's Qwen3-VL and Qwen3.5 always interleave, so ``default_interleaved`` is what a config
    without ``mrope_interleaved`` means for the family."""
    section = rope_params.get("mrope_section")
    if not section or len(section) != 3:
        raise ValueError(f"rope_parameters.mrope_section must list 3 sizes (t, h, w), got "
                         f"{section!r}; is this a vision-language config?")
    return [int(s) for s in section], bool(rope_params.get("mrope_interleaved",
                                                           default_interleaved))


def axis_of_frequency(section: Sequence[int], interleaved: bool, num_freqs: int) -> torch.Tensor:
    """For each of the ``num_freqs`` rotary frequencies, which position row drives it (0, 1, 2)."""
    if sum(section) != num_freqs:
        raise ValueError(f"mrope_section {list(section)} sums to {sum(section)} but the rotary "
                         f"embedding has {num_freqs} frequencies (rotary_dim / 2)")
    if interleaved:
        axes = []
        for i in range(num_freqs):
            if i % 3 == 1 and i < 3 * section[1]:
                axes.append(1)
            elif i % 3 == 2 and i < 3 * section[2]:
                axes.append(2)
            else:
                axes.append(0)
        return torch.tensor(axes, dtype=torch.long)
    return torch.repeat_interleave(torch.arange(3), torch.tensor(list(section)))


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE for ``[3, T]`` positions (also accepts ``[T]``: plain RoPE).

    Same call as ``RotaryEmbedding``: ``forward(positions, q [T, Hq, D], k [T, Hkv, D])``
    rotates the first ``rotary_dim`` dims of each head (Qwen3.5 rotates a quarter).
    """

    def __init__(self, config: PretrainedConfig, head_dim: int, rotary_dim: int, max_position: int,
                 section: Sequence[int], interleaved: bool,
                 kernels: ElementwiseKernels | None = None) -> None:
        rope_type, _ = rope_parameters(config)
        if rope_type != "default":
            raise ValueError(f"M-RoPE supports rope_type 'default', not {rope_type!r}")
        # kernels: the fused rotary for [T] positions (text-only steps), as RotaryEmbedding's
        super().__init__(config, head_dim, rotary_dim, max_position, kernels)
        axes = axis_of_frequency(section, interleaved, rotary_dim // 2)
        self.register_buffer("axis_of_dim", torch.cat((axes, axes)), persistent=False)  # [R]

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.ndim == 1:
            return super().forward(positions, q, k)
        cos = self._select(self.cos, positions).to(q.dtype).unsqueeze(1)  # [T, 1, R]
        sin = self._select(self.sin, positions).to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _select(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """table [max_position, R], positions [3, T] -> [T, R], dim r from row axis_of_dim[r]."""
        per_axis = table[positions]  # [3, T, R]
        index = self.axis_of_dim.view(1, 1, -1).expand(1, positions.shape[1], -1)
        return per_axis.gather(0, index)[0]
