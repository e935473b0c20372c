"""Recurrent-state roll-back for speculative decoding on hybrid models (Gated DeltaNet).

A verify chunk advances each DeltaNet layer's conv and SSM state over all 1 + k tokens, the
rejected drafts included; attention KV needs no undo (it is overwritten later), the state does.
Chosen here: **recompute**. Before the forward pass the states of the verifying requests are
copied aside (one ``index_select`` per state tensor: a transient copy, ~1 MB per DeltaNet layer
and request at Qwen3.5-0.8B's shapes); after verification, requests with a rejection get their
copy back and run a second, small forward pass over the tokens they kept (the last token and
the accepted drafts), which leaves the state exactly where plain decoding would have it.

The alternative, kernels that output the state after every position of the chunk, would avoid
the second pass but needs k + 1 states per request from the recurrent kernels; recompute costs
at most one extra pass over 1 + a tokens, and nothing when every draft is accepted.
"""

from __future__ import annotations

import torch

from qwenserve.layers.caches import ModelCaches


def _pools(caches: ModelCaches) -> list[torch.Tensor]:
    return [pool for state in caches.state.values() for pool in (state.conv, state.ssm)]


def snapshot(caches: ModelCaches, slots: list[int], device: torch.device) -> list[torch.Tensor]:
    """Copies of the given state slots, for every recurrent pool (conv and SSM per layer)."""
    index = torch.tensor(slots, dtype=torch.long, device=device)
    return [pool.index_select(0, index) for pool in _pools(caches)]


def restore(caches: ModelCaches, slots: list[int], saved: list[torch.Tensor], rows: list[int],
            device: torch.device) -> None:
    """Put back rows ``rows`` of a snapshot into slots ``slots`` (same order)."""
    dst = torch.tensor(slots, dtype=torch.long, device=device)
    src = torch.tensor(rows, dtype=torch.long, device=device)
    for pool, copy in zip(_pools(caches), saved, strict=True):
        pool.index_copy_(0, dst, copy.index_select(0, src))
