"""Allocate every layer's cache for a cache plan: paged KV tensors and recurrent-state pools."""

from __future__ import annotations

from typing import Protocol

import torch

from qwenserve.core.cache.spec import CacheSpec, PagedKVSpec
from qwenserve.layers.caches import ModelCaches, RecurrentState


class HasStatePools(Protocol):
    def allocate_state(self, num_state_slots: int, device: torch.device
                       ) -> list[RecurrentState]: ...


def allocate_caches(specs: list[CacheSpec], model: HasStatePools, num_blocks: int,
                    block_size: int, num_state_slots: int, dtype: torch.dtype,
                    device: torch.device, zeroed: bool) -> ModelCaches:
    """``zeroed=False`` leaves the KV uninitialised but block 0 (padding rows read it)."""
    caches = ModelCaches()
    num_kv_slots = num_blocks * block_size
    for spec in specs:
        if isinstance(spec, PagedKVSpec):
            for layer_id in spec.layer_ids:
                make = torch.zeros if zeroed else torch.empty
                kv = make(2, num_kv_slots, spec.num_kv_heads, spec.head_dim, dtype=dtype,
                          device=device)  # [K|V, num_kv_slots, Hkv, D]
                kv[:, :block_size].zero_()
                caches.kv[layer_id] = kv
        else:
            states = model.allocate_state(num_state_slots, device)
            caches.state.update(zip(spec.layer_ids, states, strict=True))
    return caches
