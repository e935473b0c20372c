"""Speculative decoding across tensor-parallel ranks: what the driver's sampler tells the others.

Only the driver samples, and the next step's drafts reach every rank in the scheduler's
output, so plain verification needs nothing more. Two things do, within the step:

    sharded drafter (MTP, EAGLE-3, a draft model at the target's TP): its layers hold
        collectives, so every rank runs ``forward`` and ``propose`` in lock-step with the same
        batches. Ranks other than the driver need the tokens just emitted (the MTP catch-up
        reads the token after each kept position; ``propose`` starts after the newest) and the
        requests the driver drafts for (it skips grammar-constrained ones; only it holds the
        matchers). Drafts come out identical on every rank: the head's input rows are
        all-reduced, its logits all-gathered, and the argmax is taken over the same values.
    hybrid target (Gated DeltaNet): a rejection rolls back and recomputes the request's
        recurrent state (``state_rollback.py``); that forward pass holds collectives too, and
        every rank must know how many drafts each request kept.

One collective over the CPU group per step that needs it carries both; steps with neither
(dense target with n-gram lookup or a driver-only drafter) send nothing. Every rank knows the
step's sampled chunks and their draft counts, so the message has a fixed layout: one small
integer all-reduce (MAX; the other ranks send -1) instead of a pickled broadcast (two
collectives and pickling):

    per sampled chunk, in the step's order:   1 + num_draft_tokens slots   + 1 slot
                                              emitted ids, -1 padded        draftable (0 / 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from qwenserve.core.sched_output import ScheduledChunk
from qwenserve.distributed.parallel_group import SINGLE, ParallelGroup


@dataclass(frozen=True)
class StepTokens:
    """Plain data: per sampled chunk (in the step's order) the tokens it emitted (accepted
    drafts, then the new token), and the requests the driver drafts for next."""

    emitted: list[list[int]] = field(default_factory=list)
    draftable: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SpecRanks:
    """``every_rank``: the proposer runs on every rank (its layers are sharded)."""

    tp: ParallelGroup = SINGLE
    every_rank: bool = False

    def must_share(self, verifying_hybrid: bool) -> bool:
        """Whether this step sends ``StepTokens`` (``share``); every rank answers the same (the
        inputs are the scheduler's output and the configuration)."""
        return self.tp.world_size > 1 and (self.every_rank or verifying_hybrid)

    def share(self, sampled: Sequence[ScheduledChunk], tokens: StepTokens | None
              ) -> StepTokens:
        """The driver's ``tokens`` (for the step's ``sampled`` chunks) on every rank; the other
        ranks pass None."""
        widths = [1 + c.num_draft_tokens for c in sampled]
        if not widths:  # e.g. a step of prefill chunks only: every rank knows there is nothing
            return StepTokens()
        if tokens is None:
            flat = [-1] * (sum(widths) + len(widths))
        else:
            draftable = set(tokens.draftable)
            flat = []
            for chunk, width, emitted in zip(sampled, widths, tokens.emitted, strict=True):
                flat += emitted + [-1] * (width - len(emitted))
                flat.append(int(chunk.request_id in draftable))
        got = self.tp.max_flags(flat)
        emitted_all, draftable_ids, start = [], [], 0
        for chunk, width in zip(sampled, widths):
            emitted_all.append([t for t in got[start : start + width] if t >= 0])
            if got[start + width]:
                draftable_ids.append(chunk.request_id)
            start += width + 1
        return StepTokens(emitted_all, draftable_ids)


DRIVER_ONLY = SpecRanks()  # one rank: nothing to share
