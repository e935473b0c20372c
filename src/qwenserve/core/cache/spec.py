"""What each group of layers needs from the cache, in bytes (no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PagedKVSpec:
    """Full-attention layers: K and V per token, stored in fixed-size blocks.

    ``num_kv_heads`` is per rank (KV heads split over tensor parallelism, replicated when fewer).
    """

    layer_ids: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * len(self.layer_ids) * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class RecurrentStateSpec:
    """Linear-attention (Gated DeltaNet) layers: a fixed-size state per sequence.

    ``conv_bytes`` and ``ssm_bytes`` are per layer and per sequence.
    """

    layer_ids: tuple[int, ...]
    conv_bytes: int
    ssm_bytes: int

    @property
    def bytes_per_seq(self) -> int:
        return len(self.layer_ids) * (self.conv_bytes + self.ssm_bytes)


CacheSpec = PagedKVSpec | RecurrentStateSpec
