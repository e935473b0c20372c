"""ModelRunner: SchedulerOutput -> ForwardBatch -> logits -> sampled tokens.

It keeps per-request state across steps (block table, sampling parameters, seeded generator and
the token history for penalties); the scheduler only sends what changed. With speculative
decoding, chunks carrying draft tokens are verified (``spec_decode/rejection.py``) and the
proposer drafts the next tokens of every request it sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qwenserve.config import PoolerConfig
from qwenserve.core.sched_output import ModelOutput, ScheduledChunk, SchedulerOutput
from qwenserve.layers.attention.base import ChunkLayout
from qwenserve.layers.backends import Backends
from qwenserve.layers.caches import ModelCaches
from qwenserve.layers.forward_batch import ForwardBatch
from qwenserve.models.base import CausalLM
from qwenserve.sampling_params import SamplingParams
from qwenserve.spec_decode import state_rollback
from qwenserve.spec_decode.lockstep import DRIVER_ONLY, SpecRanks, StepTokens
from qwenserve.spec_decode.proposer import Proposer
from qwenserve.spec_decode.rejection import verify
from qwenserve.structured_output.request_grammars import RequestGrammars
from qwenserve.worker.decode_replay import DecodeReplays
from qwenserve.worker.dp_passes import LockstepPasses
from qwenserve.worker.mm_inputs import EncoderCache, RequestImages, build_mm_batch
from qwenserve.worker.pooler import TokenOutputs, pool, score_tokens
from qwenserve.worker.sampler import (
    SampledToken,
    SamplingRow,
    plain_greedy,
    prompt_logprobs,
    sample,
)

# Rows of prompt logits scored at once: [rows, vocab] fp32 stays ~150 MB at a 152k vocabulary.
PROMPT_LOGPROBS_ROWS = 256


@dataclass
class RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    state_slot: int | None
    generator: torch.Generator | None


@dataclass
class PromptScoring:
    """The rows of one chunk whose logits score the next prompt token (``prompt_logprobs``)."""

    request_id: str
    first_pos: int  # position of the first row's token in its request
    first_row: int  # its row in the step's batch
    target_token_ids: list[int]  # the prompt tokens that follow positions first_pos, ...
    num_logprobs: int


class ModelRunner:
    # DP x EP: the MoE passes every replica runs each step, padded where this one has less
    # (set by the worker: ``dp_passes.py``)
    lockstep: LockstepPasses | None = None

    def __init__(self, model: CausalLM, caches: ModelCaches, backends: Backends, block_size: int,
                 device: torch.device, is_driver: bool = True, seed: int = 0,
                 has_state: bool = False, grammars: RequestGrammars | None = None,
                 pooler: PoolerConfig | None = None,
                 proposer: Proposer | None = None, spec_ranks: SpecRanks = DRIVER_ONLY) -> None:
        self.model = model
        self.caches = caches
        self.attn_backend = backends.attention
        # Models with Gated DeltaNet layers get the recurrent kernels' metadata each step.
        self.recurrent_backend = backends.recurrent if has_state else None
        self.sampling_kernel = backends.sampling
        self.block_size = block_size
        self.device = device
        self.is_driver = is_driver
        self.requests: dict[str, RequestState] = {}
        # Structured outputs and thinking budgets: the driver's matchers (None on other ranks).
        self.grammars = grammars
        self.pooler = pooler  # --runner pooling: pooled outputs instead of samples
        self.token_outputs = TokenOutputs()  # reward pooling: outputs of prompts in progress
        # Speculative decoding: on the driver, or on every rank when its layers are sharded.
        self.proposer = proposer
        self.spec_ranks = spec_ranks
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # Requests with images, and the vision tower's outputs they hold (worker/mm_inputs.py)
        self.images: dict[str, RequestImages] = {}
        self.encoder_cache = EncoderCache()
        # decode-only steps replayed from recorded native calls (set by the worker)
        self.decode_replays: DecodeReplays | None = None

    # ---- state --------------------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_request_ids + sched.preempted_request_ids:
            if request_id in self.images:  # preempted: re-encoded when recomputed
                self.encoder_cache.release_all(request_id, self.images[request_id])
        for request_id in sched.finished_request_ids:
            self.requests.pop(request_id, None)
            self.token_outputs.drop(request_id)
            self.images.pop(request_id, None)
            if self.grammars is not None:
                self.grammars.remove(request_id)
        for new in sched.new_requests:
            if self.grammars is not None and not self.grammars.has(new.request_id):
                self.grammars.add(new.request_id, new.sampling_params, new.output_token_ids)
            if new.mm_inputs is not None and new.request_id not in self.images:
                self.images[new.request_id] = RequestImages.build(
                    new.mm_inputs, len(new.prompt_token_ids))
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
            if self.lockstep is not None:  # the other replicas may step: meet their passes
                self.lockstep.idle_step()
            return ModelOutput()
        # Single-token chunks (decodes) first: the attention backend batches them together.
        chunks = sorted(sched.chunks, key=lambda c: len(c.token_ids) != 1)
        batch = self._prepare(chunks)
        self._copy_states(sched.state_saves)  # before the restores: they may read a new save
        self._copy_states(sched.state_restores)
        verifying = [c for c in chunks if c.num_draft_tokens] \
            if self.recurrent_backend is not None else []
        saved = None if not verifying else state_rollback.snapshot(
            self.caches, [self.requests[c.request_id].state_slot for c in verifying],
            self.device)
        if saved is None and self.lockstep is not None and self.lockstep.vote_rollback:
            saved = []  # nothing to roll back here, but the replicas vote on it every step
        hidden = None if self.decode_replays is None or saved is not None \
            else self.decode_replays.forward(batch, self.caches)
        if hidden is None:
            hidden = self.model(batch.input_ids, batch.positions, batch, self.caches)
        if self.pooler is not None and self.pooler.kind == "reward":
            return self._pooled_tokens(chunks, hidden)
        if self.pooler is not None:
            return self._pooled(chunks, hidden[batch.logits_indices])
        if self.proposer is not None:
            self.proposer.forward(batch, hidden, chunks)
        sampled_chunks = [c for c in chunks if c.sample]
        sampled_hidden = hidden[batch.logits_indices]
        if self.is_driver:
            emitted = self._sample(sampled_hidden, sampled_chunks)
        else:  # the LM head gathers its logits over the ranks: a collective every rank joins
            self.model.compute_logits(sampled_hidden, dtype=None)
            emitted = None
        scored = {s.request_id: (s.first_pos, self._score_prompt(hidden, s))
                  for s in self._prompt_scoring(chunks)}
        shared = None
        if self.spec_ranks.must_share(saved is not None):
            mine = None if emitted is None else StepTokens(
                [[t.token_id for t in tokens] for tokens in emitted],
                self._draftable(sampled_chunks) if self.proposer is not None else [])
            shared = self.spec_ranks.share(sampled_chunks, mine)
        if saved is not None:
            counts = [len(t) - 1 for t in (emitted if emitted is not None else shared.emitted)]
            self._roll_back_states(verifying, saved, dict(zip(
                [c.request_id for c in sampled_chunks], counts)))
        if not self.is_driver:
            if self.proposer is not None:  # sharded: the same passes as the driver's
                assert shared is not None
                for chunk, token_ids in zip(sampled_chunks, shared.emitted, strict=True):
                    self.requests[chunk.request_id].output_token_ids.extend(token_ids)
                self.proposer.propose(shared.draftable, self.requests)
            return ModelOutput()
        output = ModelOutput(prompt_logprobs=scored)
        for chunk, tokens in zip(sampled_chunks, emitted):
            state = self.requests[chunk.request_id]
            for token in tokens:
                state.output_token_ids.append(token.token_id)
                if self.grammars is not None:
                    self.grammars.accept(chunk.request_id, token.token_id)
            if len(tokens) > 1:
                output.accepted[chunk.request_id] = tokens[:-1]
            output.sampled[chunk.request_id] = tokens[-1]
        if self.proposer is not None:
            output.draft_token_ids = self.proposer.propose(
                shared.draftable if shared is not None else self._draftable(sampled_chunks),
                self.requests)
        return output

    def _pooled(self, chunks: list[ScheduledChunk], last_hidden: torch.Tensor) -> ModelOutput:
        """Prefill-only: each prompt's pooled output when its last chunk ran (no sampling)."""
        pooled = pool(self.model, self.pooler, last_hidden)  # [num_finished_prompts, D]
        if not self.is_driver:
            return ModelOutput()
        finished = [c.request_id for c in chunks if c.sample]
        return ModelOutput(pooled=dict(zip(finished, pooled.cpu().tolist(), strict=True)))

    def _pooled_tokens(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> ModelOutput:
        """Reward pooling (vLLM's "ALL"): every token's output, gathered over a prompt's chunks
        and sent when its last chunk ran. The score head is whole on each rank: only the
        driver computes it."""
        if not self.is_driver:
            return ModelOutput()
        out = ModelOutput()
        row = 0
        for c in chunks:  # rows in the batch order of _prepare
            n = len(c.token_ids)
            rows = score_tokens(self.model, self.pooler, hidden[row : row + n])  # [n, D]
            self.token_outputs.add(c.request_id, c.start_pos, rows)
            if c.sample:
                out.pooled[c.request_id] = self.token_outputs.finish(c.request_id).cpu().tolist()
            row += n
        return out

    def _roll_back_states(self, verifying: list[ScheduledChunk], saved: list[torch.Tensor],
                          num_accepted: dict[str, int]) -> None:
        """Hybrid models: requests that rejected a draft get their pre-step recurrent state
        back, then recompute it over the tokens they kept (``spec_decode/state_rollback.py``).
        DP x EP: every replica votes first, so all or none run the recompute's MoE passes."""
        redo = [(i, c) for i, c in enumerate(verifying)
                if num_accepted[c.request_id] < c.num_draft_tokens]
        if self.lockstep is not None:
            self.lockstep.rollback(bool(redo))
        if not redo:
            return
        state_rollback.restore(self.caches, [self.requests[c.request_id].state_slot
                                             for _, c in redo], saved, [i for i, _ in redo],
                               self.device)
        kept = [ScheduledChunk(c.request_id, c.token_ids[: 1 + num_accepted[c.request_id]],
                               c.start_pos, [], False) for _, c in redo]
        kept.sort(key=lambda c: len(c.token_ids) != 1)
        batch = self._prepare(kept)
        self.model(batch.input_ids, batch.positions, batch, self.caches)

    def _sample(self, hidden: torch.Tensor, chunks: list[ScheduledChunk]
                ) -> list[list[SampledToken]]:
        """Per sampled chunk, the tokens it emits: one, or with drafts the accepted ones and
        the next (``hidden`` has 1 + num_draft_tokens rows per chunk). A step whose rows are
        all plain greedy takes the model's fused greedy LM head where it has one (no logits)."""
        if not any(c.num_draft_tokens for c in chunks):
            rows = [self._sampling_row(c.request_id) for c in chunks]
            constrained = self.grammars is not None and any(
                self.grammars.has(c.request_id) for c in chunks)
            tokens = self.model.greedy_tokens(hidden) \
                if not constrained and plain_greedy(rows) else None
            if tokens is not None:
                return [[SampledToken(t)] for t in tokens.tolist()]
            # in the LM head's dtype: the sampler widens them to float32 only where it must
            logits = self.model.compute_logits(hidden, dtype=None)
            bitmask = None if self.grammars is None else self.grammars.bitmask(
                [c.request_id for c in chunks], logits.shape[1])
            return [[t] for t in sample(logits, rows, self.generator, bitmask,
                                        self.sampling_kernel)]
        logits = self.model.compute_logits(hidden, dtype=None)
        rows, row_ids, drafts = [], [], []
        for c in chunks:
            draft = c.token_ids[len(c.token_ids) - c.num_draft_tokens:]
            drafts.append(draft)
            rows += [self._sampling_row(c.request_id, draft[:j]) for j in range(len(draft) + 1)]
            row_ids += [c.request_id] * (len(draft) + 1)
        bitmask = None if self.grammars is None else self.grammars.bitmask(
            row_ids, logits.shape[1])
        return verify(logits.float(), rows, drafts, self.generator, bitmask,
                      kernel=self.sampling_kernel)

    def _draftable(self, chunks: list[ScheduledChunk]) -> list[str]:
        """Requests to draft for: not grammar-constrained (their drafts would have to be
        checked against the matcher; they simply decode one token a step)."""
        return [c.request_id for c in chunks
                if self.grammars is None or not self.grammars.has(c.request_id)]

    def _copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy recurrent-state slots (conv and SSM state of every DeltaNet layer) src -> dst;
        all sources are read before any destination is written."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        self.caches.copy_states(src, dst)

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
            if c.sample:  # a verify chunk: a row per draft token and one after them
                logits_indices.extend(range(len(input_ids) - 1 - c.num_draft_tokens,
                                            len(input_ids)))
        device = self.device
        state = None
        if self.recurrent_backend is not None:
            query_start_loc = [c.q_start for c in layouts] + [len(input_ids)]
            slots = [self.requests[c.request_id].state_slot for c in chunks]
            state = self.recurrent_backend.build_metadata(
                query_start_loc, slots, [c.start_pos > 0 for c in layouts], device,
                [c.state_checkpoint for c in chunks])
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            attn=self.attn_backend.build_metadata(layouts, self.block_size, device),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
            state=state,
            mm=build_mm_batch(chunks, self.images, self.encoder_cache,
                              getattr(self.model, "encode_images", None), device),
        )

    def _prompt_scoring(self, chunks: list[ScheduledChunk]) -> list[PromptScoring]:
        """Chunks of prompt_logprobs requests that still hold prompt positions to score (rows in
        the batch order of ``_prepare``: the chunks' tokens concatenated)."""
        out, row = [], 0
        for c in chunks:
            state = self.requests[c.request_id]
            num_prompt = len(state.prompt_token_ids)
            end = min(c.start_pos + len(c.token_ids), num_prompt - 1)  # last position scores P-1
            if state.params.prompt_logprobs is not None and end > c.start_pos:
                out.append(PromptScoring(c.request_id, c.start_pos, row,
                                         state.prompt_token_ids[c.start_pos + 1 : end + 1],
                                         state.params.prompt_logprobs))
            row += len(c.token_ids)
        return out

    def _score_prompt(self, hidden: torch.Tensor, scoring: PromptScoring) -> list:
        """Logprobs of the prompt tokens, a slice of rows at a time (every rank computes the
        logits: the LM head's all-gather is a collective)."""
        entries = []
        for start in range(0, len(scoring.target_token_ids), PROMPT_LOGPROBS_ROWS):
            targets = scoring.target_token_ids[start : start + PROMPT_LOGPROBS_ROWS]
            first = scoring.first_row + start
            # as the LM head gives them (bf16 in a bf16 model): the logprobs widen what they read
            logits = self.model.compute_logits(hidden[first : first + len(targets)], None)
            if self.is_driver:
                entries += prompt_logprobs(logits, targets, scoring.num_logprobs,
                                           self.sampling_kernel)
        return entries

    def _sampling_row(self, request_id: str, drafts: list[int] | None = None) -> SamplingRow:
        """``drafts``: the draft tokens before this row, part of its history for penalties."""
        state = self.requests[request_id]
        output = state.output_token_ids + drafts if drafts else state.output_token_ids
        return SamplingRow(state.params, state.prompt_token_ids, output, state.generator)
