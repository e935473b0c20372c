"""Attention backend seam.

``build_metadata`` runs once per step on the batch layout; ``forward`` runs in every attention
layer: it writes the step's K/V into the paged cache at ``slot_mapping`` and attends each query
token over its request's context through the request's block table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkLayout:
    """Host-side description of one request's chunk in the packed batch.

    The batch concatenates the chunks: request i's tokens are rows
    ``[q_start, q_start + q_len)``; they sit at positions ``[start_pos, start_pos + q_len)`` of
    the request, whose first ``start_pos`` tokens are already in the cache.
    """

    q_start: int
    q_len: int
    start_pos: int
    block_ids: list[int]

    @property
    def ctx_len(self) -> int:
        return self.start_pos + self.q_len


class AttentionMetadata:
    """What one backend's ``build_metadata`` returns: each backend subclasses it with the index
    tensors its ``forward`` reads (built once per step, shared by every attention layer)."""


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def build_metadata(self, chunks: list[ChunkLayout], block_size: int,
                       device: torch.device) -> AttentionMetadata:
        """Tensors every layer needs for this step (built once per step)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], kv_cache [2, num_kv_slots, Hkv, D] -> out [T, Hq, D]."""

    def replay_metadata(self, meta: AttentionMetadata, width: int,
                        kv_cache: torch.Tensor) -> AttentionMetadata | None:
        """For a decode-only step's ``meta``: the same metadata in buffers of its own, block
        tables ``width`` blocks wide, that ``refill`` loads any later decode-only step of as
        many sequences into (a recorded step reads its inputs there: worker/decode_replay.py).
        None where this backend's decode of ``kv_cache`` (a layer's) is not native calls on
        such buffers (the default)."""
        return None

    def refill(self, static: AttentionMetadata, meta: AttentionMetadata) -> bool:
        """Copy ``meta`` into ``static`` (``replay_metadata``'s); False where it does not fit
        (another number of sequences, a wider block table, prefill rows)."""
        raise NotImplementedError(f"{self.name} has no replayable metadata")


def kv_slot_ids(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat KV slots of positions ``[start, end)``: ``block_ids[p // bs] * bs + p % bs``."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
