"""A smaller model with the target's vocabulary drafts k tokens, greedily, one at a time.

Its KV cache is a paged group of its own with the target's block layout: same block size and
block count, and the same block table per request, so token position p of a request sits in the
same slot of both caches and the scheduler's allocation (with k lookahead slots) covers both.

    every step:   the drafter runs the target's batch too (prefill chunks, verify chunks), so
                  its KV covers every token the target computed, accepted drafts included
    propose:      from the last token (position p, not yet in either cache) k decode steps:
                  p -> d1, p+1 -> d2, ...; their KV is overwritten when the next verify chunk
                  runs the same positions

Drafts are argmaxes (q one-hot), which the rejection sampler accepts with probability p(d).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from qwenserve.core.sched_output import ScheduledChunk
from qwenserve.layers.attention.base import AttentionBackend, ChunkLayout
from qwenserve.layers.caches import ModelCaches
from qwenserve.layers.forward_batch import ForwardBatch
from qwenserve.models.base import CausalLM
from qwenserve.spec_decode.proposer import RequestTokens, greedy_drafts, too_many


class DraftModelProposer:
    def __init__(self, model: CausalLM, caches: ModelCaches, attn_backend: AttentionBackend,
                 block_size: int, device: torch.device, num_tokens: int,
                 disable_by_batch_size: int | None = None) -> None:
        self.model = model
        self.caches = caches
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.device = device
        self.num_tokens = num_tokens
        self.disable_by_batch_size = disable_by_batch_size

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None,
                chunks: Sequence[ScheduledChunk] = ()) -> None:
        """Run the target's batch through the drafter: its KV for the step's tokens."""
        self.model(batch.input_ids, batch.positions, batch, self.caches)

    def propose(self, request_ids: list[str], requests: Mapping[str, RequestTokens]
                ) -> dict[str, list[int]]:
        if too_many(request_ids, self.disable_by_batch_size):
            return {}
        drafts: dict[str, list[int]] = {rid: [] for rid in request_ids}
        last = {rid: requests[rid].output_token_ids[-1] if requests[rid].output_token_ids
                else requests[rid].prompt_token_ids[-1] for rid in request_ids}
        start = {rid: len(requests[rid].prompt_token_ids) + len(requests[rid].output_token_ids)
                 - 1 for rid in request_ids}
        for step in range(self.num_tokens):
            # Only inside the blocks the scheduler allocated (k lookahead slots, when they fit).
            active = [rid for rid in request_ids
                      if start[rid] + step < len(requests[rid].block_ids) * self.block_size]
            if not active:
                break
            layouts = [ChunkLayout(i, 1, start[rid] + step, requests[rid].block_ids)
                       for i, rid in enumerate(active)]
            tokens = [drafts[rid][-1] if step else last[rid] for rid in active]
            batch = ForwardBatch(
                input_ids=torch.tensor(tokens, dtype=torch.long, device=self.device),
                positions=torch.tensor([start[rid] + step for rid in active], dtype=torch.long,
                                       device=self.device),
                attn=self.attn_backend.build_metadata(layouts, self.block_size, self.device),
                logits_indices=torch.arange(len(active), device=self.device),
            )
            hidden = self.model(batch.input_ids, batch.positions, batch, self.caches)
            for rid, token in zip(active, greedy_drafts(self.model, hidden)):
                drafts[rid].append(token)
        return {rid: d for rid, d in drafts.items() if d}
