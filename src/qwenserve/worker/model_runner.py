"""ModelRunner: SchedulerOutput -> ForwardBatch -> logits -> sampled tokens.

It keeps per-request state across steps (block table, sampling parameters, seeded generator and
the token history for penalties); the scheduler only sends what changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qwenserve.core.sched_output import ModelOutput, ScheduledChunk, SchedulerOutput
from qwenserve.layers.attention.base import ChunkLayout
from qwenserve.sampling_params import SamplingParams
from qwenserve.worker.forward_batch import ForwardBatch
from qwenserve.worker.sampler import SamplingRow, sample


@dataclass
class RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    state_slot: int | None
    generator: torch.Generator | None


class ModelRunner:
    def __init__(self, model: Any, caches: list[Any], attn_backend: Any, block_size: int,
                 device: torch.device, is_driver: bool = True, seed: int = 0,
                 recurrent_backend: Any = None) -> None:
        self.model = model
        self.caches = caches
        self.attn_backend = attn_backend
        self.recurrent_backend = recurrent_backend
        self.block_size = block_size
        self.device = device
        self.is_driver = is_driver
        self.requests: dict[str, RequestState] = {}
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    # ---- state --------------------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in sched.new_requests:
            old = self.requests.get(new.request_id)
            if old is not None:  # resumed after preemption: keep the generator's position
                old.block_ids, old.state_slot = list(new.block_ids), new.state_slot
                continue
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.sampling_params.seed)
            self.requests[new.request_id] = RequestState(
                list(new.prompt_token_ids), list(new.output_token_ids), new.sampling_params,
                list(new.block_ids), new.state_slot, generator)
        for chunk in sched.chunks:
            self.requests[chunk.request_id].block_ids.extend(chunk.new_block_ids)

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        self._update_states(sched)
        if sched.is_empty:
            return ModelOutput()
        # Single-token chunks (decodes) first: the attention backend batches them together.
        chunks = sorted(sched.chunks, key=lambda c: len(c.token_ids) != 1)
        batch = self._prepare(chunks)
        hidden = self.model(batch.input_ids, batch.positions, batch, self.caches)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if not self.is_driver:
            return ModelOutput()
        sampled_chunks = [c for c in chunks if c.sample]
        rows = [self._sampling_row(c.request_id) for c in sampled_chunks]
        tokens = sample(logits, rows, self.generator)
        output = ModelOutput()
        for chunk, token in zip(sampled_chunks, tokens):
            self.requests[chunk.request_id].output_token_ids.append(token.token_id)
            output.sampled[chunk.request_id] = token
        return output

    def _prepare(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        layouts: list[ChunkLayout] = []
        logits_indices: list[int] = []
        for c in chunks:
            n = len(c.token_ids)
            layouts.append(ChunkLayout(len(input_ids), n, c.start_pos,
                                       self.requests[c.request_id].block_ids))
            input_ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, c.start_pos + n))
            if c.sample:
                logits_indices.append(len(input_ids) - 1)
        device = self.device
        state = None
        if self.recurrent_backend is not None:
            query_start_loc = [c.q_start for c in layouts] + [len(input_ids)]
            slots = [self.requests[c.request_id].state_slot for c in chunks]
            state = self.recurrent_backend.build_metadata(
                query_start_loc, slots, [c.start_pos > 0 for c in layouts], device)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            attn=self.attn_backend.build_metadata(layouts, self.block_size, device),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
            state=state,
        )

    def _sampling_row(self, request_id: str) -> SamplingRow:
        state = self.requests[request_id]
        return SamplingRow(state.params, state.prompt_token_ids, state.output_token_ids,
                           state.generator)
