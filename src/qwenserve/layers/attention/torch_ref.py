"""Pure-PyTorch paged attention: the CPU path and the oracle for faster backends.

Decodes (one query token) are batched into a single SDPA call over contexts gathered from the
cache and padded to the longest; each prefill chunk gets its own causal SDPA call.

    batch rows:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]     decodes first, then prefill chunks
    decode_slots [3, Lmax]: the cache slots of each decode's context, padded with slot 0
    decode_mask  [3, 1, 1, Lmax]: True where the position is inside the context
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from qwenserve.layers.attention.base import AttentionBackend, ChunkLayout, slot_ids


@dataclass
class PrefillSpan:
    q_start: int
    q_len: int
    ctx_slots: torch.Tensor | None  # [ctx_len] when earlier tokens are cached, else None


@dataclass
class TorchRefMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decodes: int  # rows [0, num_decodes) are single-token decodes
    decode_slots: torch.Tensor | None  # [num_decodes, Lmax]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, Lmax]
    prefills: list[PrefillSpan]


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def build_metadata(self, chunks: list[ChunkLayout], block_size: int,
                       device: torch.device) -> TorchRefMetadata:
        slots: list[int] = []
        for c in chunks:
            slots += slot_ids(c.block_ids, c.start_pos, c.ctx_len, block_size)
        decodes = [c for c in chunks if c.q_len == 1]
        if any(c.q_len == 1 for c in chunks[len(decodes):]) or chunks[: len(decodes)] != decodes:
            raise ValueError("single-token chunks must come first in the batch")
        return TorchRefMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            num_decodes=len(decodes),
            **self._decode_tensors(decodes, block_size, device),
            prefills=[self._prefill_span(c, block_size, device) for c in chunks[len(decodes):]],
        )

    @staticmethod
    def _decode_tensors(decodes: list[ChunkLayout], block_size: int,
                        device: torch.device) -> dict:
        if not decodes:
            return {"decode_slots": None, "decode_mask": None}
        max_len = max(c.ctx_len for c in decodes)
        rows = [slot_ids(c.block_ids, 0, c.ctx_len, block_size) for c in decodes]
        padded = [r + [0] * (max_len - len(r)) for r in rows]
        lens = torch.tensor([c.ctx_len for c in decodes], device=device)
        mask = torch.arange(max_len, device=device)[None, :] < lens[:, None]
        return {
            "decode_slots": torch.tensor(padded, dtype=torch.long, device=device),
            "decode_mask": mask[:, None, None, :],
        }

    @staticmethod
    def _prefill_span(c: ChunkLayout, block_size: int, device: torch.device) -> PrefillSpan:
        if c.start_pos == 0:
            return PrefillSpan(c.q_start, c.q_len, None)
        ctx = torch.tensor(slot_ids(c.block_ids, 0, c.ctx_len, block_size), dtype=torch.long,
                           device=device)
        return PrefillSpan(c.q_start, c.q_len, ctx)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: TorchRefMetadata, scale: float) -> torch.Tensor:
        kv_cache[0].index_copy_(0, meta.slot_mapping, k)  # [num_slots, Hkv, D]
        kv_cache[1].index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if meta.num_decodes:
            n = meta.num_decodes
            out[:n] = _decode(q[:n], kv_cache, meta, scale)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            if span.ctx_slots is None:
                ks, vs = k[rows], v[rows]
            else:
                ks, vs = kv_cache[:, span.ctx_slots].unbind(0)  # one gather for K and V
            out[rows] = _prefill(q[rows], ks, vs, scale)
        return out


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: TorchRefMetadata,
            scale: float) -> torch.Tensor:
    """q [n, Hq, D] -> [n, Hq, D]. The G = Hq/Hkv query heads sharing a KV head take the place
    of the query-length axis, so grouped-query attention needs no copies of K and V."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[2]
    qg = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    kv = kv_cache[:, meta.decode_slots].transpose(2, 3)  # [2, n, Hkv, Lmax, D], one gather
    o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=meta.decode_mask,
                                       scale=scale)
    return o.reshape(n, num_heads, head_dim)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, Hq, D], k/v [S, Hkv, D] -> [L, Hq, D]. Causal, aligned at the end: query i sits at
    position S - L + i (``causal_lower_right``), so a chunk after cached tokens sees them all."""
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, len, D]
    length, ctx = q.shape[0], k.shape[0]
    if length == ctx:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                              enable_gqa=True).transpose(0, 1)
    mask = causal_lower_right(length, ctx)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                          enable_gqa=True).transpose(0, 1)
