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

from qwenserve.layers.attention.base import AttentionBackend, ChunkLayout, slot_ids


@dataclass
class PrefillSpan:
    q_start: int
    q_len: int
    ctx_slots: torch.Tensor | None  # [ctx_len] when earlier tokens are cached, else None
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = may attend


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
            return PrefillSpan(c.q_start, c.q_len, None, None)
        ctx = torch.tensor(slot_ids(c.block_ids, 0, c.ctx_len, block_size), dtype=torch.long,
                           device=device)
        q_pos = torch.arange(c.start_pos, c.ctx_len, device=device)
        mask = torch.arange(c.ctx_len, device=device)[None, :] <= q_pos[:, None]
        return PrefillSpan(c.q_start, c.q_len, ctx, mask)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: TorchRefMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_slots, Hkv, D]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if meta.num_decodes:
            n = meta.num_decodes
            out[:n] = _decode(q[:n], k_cache, v_cache, meta, scale)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            if span.ctx_slots is None:
                ks, vs = k[rows], v[rows]
            else:
                ks, vs = k_cache[span.ctx_slots], v_cache[span.ctx_slots]
            out[rows] = _prefill(q[rows], ks, vs, span.mask, scale)
        return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: TorchRefMetadata, scale: float) -> torch.Tensor:
    """q [n, Hq, D] -> [n, Hq, D]. The G = Hq/Hkv query heads sharing a KV head take the place
    of the query-length axis, so grouped-query attention needs no copies of K and V."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    qg = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    ks = k_cache[meta.decode_slots].transpose(1, 2)  # [n, Hkv, Lmax, D]
    vs = v_cache[meta.decode_slots].transpose(1, 2)
    o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=meta.decode_mask, scale=scale)
    return o.reshape(n, num_heads, head_dim)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             scale: float) -> torch.Tensor:
    """q [L, Hq, D], k/v [S, Hkv, D] -> [L, Hq, D]; causal (offset by S - L when masked)."""
    group = q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1)  # [Hq, L, D]
    kt = k.transpose(0, 1).repeat_interleave(group, dim=0) if group > 1 else k.transpose(0, 1)
    vt = v.transpose(0, 1).repeat_interleave(group, dim=0) if group > 1 else v.transpose(0, 1)
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None,
                                       scale=scale)
    return o.transpose(0, 1)
