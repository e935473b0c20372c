"""MTP proposer: the checkpoint's multi-token-prediction head drafts k tokens a step.

The head at position i reads the target's hidden state at i and the embedding of token i + 1,
and writes its own KV at i (the paged layer ``num_hidden_layers``, same block table as the
target). After every step, once the step's tokens are sampled:

    catch-up:  for every chunk the target ran (prefill chunks, decodes, verify chunks), the head
               runs over the positions the target kept: s .. s + m - 1 with the tokens that
               follow them (the prompt's next token, an accepted draft, or the token just
               sampled). Its KV then covers exactly the target's computed positions, so it
               rolls back with ``num_computed_tokens`` like the target's attention KV: a
               rejected draft's positions are simply written again later.
    draft 1:   the catch-up's output at the last kept position -> LM head -> argmax
    draft j:   position + 1, input = draft j - 1, hidden = the head's previous output
               (as vLLM feeds it); only inside the blocks the request holds.

Drafts are argmaxes (q one-hot), which the rejection sampler accepts with probability p(d), so
speculation stays lossless whatever the head proposes.

Prefix-cache hits reuse the cached blocks' MTP KV as is. The entry at a hit's last position was
written with the next token of the request that cached it, which may differ from this request's:
that one entry can only change which drafts are proposed, never the output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from qwenserve.core.sched_output import ScheduledChunk
from qwenserve.layers.attention.base import AttentionBackend, ChunkLayout
from qwenserve.layers.caches import ModelCaches
from qwenserve.layers.forward_batch import ForwardBatch
from qwenserve.layers.moe import run_idle_moe
from qwenserve.models.eagle3 import Eagle3Head
from qwenserve.models.qwen3_5_mtp import Qwen3_5MTP
from qwenserve.spec_decode.proposer import RequestTokens, greedy_drafts, too_many


class MtpProposer:
    def __init__(self, head: Qwen3_5MTP | Eagle3Head, caches: ModelCaches,
                 attn_backend: AttentionBackend,
                 block_size: int, device: torch.device, num_tokens: int,
                 max_model_len: int, disable_by_batch_size: int | None = None) -> None:
        self.head = head
        self.caches = caches  # the target's: the head's KV is layer ``num_hidden_layers``
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.device = device
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len  # the rotary table's length
        self.disable_by_batch_size = disable_by_batch_size
        self._step: tuple[list[ScheduledChunk], torch.Tensor] | None = None
        # DP x EP (``worker/dp_passes.py``): the head's MoE layer spans the replicas, so every
        # ``propose`` runs exactly num_tokens head passes, zero-token ones after the real ones.
        self.lockstep = False
        self.head_passes = 0  # real head forwards in the current ``propose`` (<= num_tokens)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None,
                chunks: Sequence[ScheduledChunk] = ()) -> None:
        """Keep the step's hidden states (rows in ``chunks`` order) for ``propose``."""
        assert hidden is not None, "the MTP head needs the target's hidden states"
        self._step = (list(chunks), hidden)

    def propose(self, request_ids: list[str], requests: Mapping[str, RequestTokens]
                ) -> dict[str, list[int]]:
        self.head_passes = 0
        drafts = self._propose(request_ids, requests)
        if self.lockstep:
            self.idle_passes(self.num_tokens - self.head_passes)
        return drafts

    def idle_passes(self, passes: int) -> None:
        """Zero-token head passes: this replica's part of the others' head MoE exchanges."""
        for _ in range(passes):
            run_idle_moe(self.head)

    def _propose(self, request_ids: list[str], requests: Mapping[str, RequestTokens]
                 ) -> dict[str, list[int]]:
        if self._step is None:
            return {}
        chunks, hidden = self._step
        self._step = None
        last = self._catch_up(chunks, hidden, requests)
        if too_many(request_ids, self.disable_by_batch_size):
            return {}
        active = [rid for rid in request_ids if rid in last]
        if not active:  # e.g. a step of prefill chunks only
            return {}
        drafts: dict[str, list[int]] = {rid: [] for rid in active}
        out = last
        for step in range(self.num_tokens):
            if step:
                # Step j + 1 writes position (last kept) + j: only inside the request's blocks.
                active = [rid for rid in active
                          if self._position(requests[rid]) + step
                          < min(len(requests[rid].block_ids) * self.block_size,
                                self.max_model_len)]
                if not active:
                    break
                positions = [self._position(requests[rid]) + step for rid in active]
                batch = self._batch([(requests[rid].block_ids, p, 1)
                                     for rid, p in zip(active, positions)],
                                    [drafts[rid][-1] for rid in active], positions)
                rows = self._head(batch.input_ids, batch.positions,
                                  torch.stack([out[rid] for rid in active]), batch)
                out = dict(zip(active, rows))
            rows = torch.stack([out[rid] for rid in active])
            for rid, token in zip(active, self.choose(active, rows, step, requests)):
                drafts[rid].append(token)
        return {rid: d for rid, d in drafts.items() if d}

    def choose(self, request_ids: list[str], rows: torch.Tensor, step: int,
               requests: Mapping[str, RequestTokens]) -> list[int]:
        """Draft ``step`` of each request from the head's output rows: the LM head's argmax
        (the tests' rigged head overrides this to propose the target's own continuation)."""
        return greedy_drafts(self.head, rows)

    @staticmethod
    def _position(state: RequestTokens) -> int:
        """The last position the target computed for a request just sampled (its newest
        token, at len - 1, is not computed yet)."""
        return len(state.prompt_token_ids) + len(state.output_token_ids) - 2

    def _catch_up(self, chunks: list[ScheduledChunk], hidden: torch.Tensor,
                  requests: Mapping[str, RequestTokens]) -> dict[str, torch.Tensor]:
        """Run the head over every position the target kept this step; returns each chunk's
        output row at its last kept position, by request id."""
        entries, row = [], 0  # (request id, block ids, start, kept, hidden rows)
        for c in chunks:
            state = requests[c.request_id]
            kept = min(len(c.token_ids), self._position(state) + 1 - c.start_pos)
            if kept > 0:
                entries.append((c.request_id, state, c.start_pos, kept, range(row, row + kept)))
            row += len(c.token_ids)
        if not entries:
            return {}
        entries.sort(key=lambda e: e[3] != 1)  # single tokens first, as the runner orders
        tokens, positions, rows, ends = [], [], [], {}
        for rid, state, start, kept, hidden_rows in entries:
            all_ids = state.prompt_token_ids + state.output_token_ids
            tokens += all_ids[start + 1 : start + 1 + kept]
            positions += range(start, start + kept)
            rows += hidden_rows
            ends[rid] = len(tokens) - 1
        batch = self._batch([(state.block_ids, start, kept)
                             for _, state, start, kept, _ in entries], tokens, positions)
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        out = self._head(batch.input_ids, batch.positions, hidden.index_select(0, index), batch)
        return {rid: out[i] for rid, i in ends.items()}

    def _head(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
              batch: ForwardBatch) -> torch.Tensor:
        self.head_passes += 1
        return self.head(input_ids, positions, hidden, batch, self.caches)

    def _batch(self, layouts: list[tuple[list[int], int, int]], tokens: list[int],
               positions: list[int]) -> ForwardBatch:
        """layouts: (block_ids, start position, number of tokens) per request, in token
        order."""
        chunk_layouts, start = [], 0
        for block_ids, pos, n in layouts:
            chunk_layouts.append(ChunkLayout(start, n, pos, block_ids))
            start += n
        device = self.device
        return ForwardBatch(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            attn=self.attn_backend.build_metadata(chunk_layouts, self.block_size, device),
            logits_indices=torch.arange(len(tokens), device=device),
        )
