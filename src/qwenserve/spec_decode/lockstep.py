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

One broadcast of ``StepTokens`` over the CPU group per step that needs it carries both; steps
with neither (dense target with n-gram lookup or a driver-only drafter) send nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        """Whether this step broadcasts ``StepTokens``; every rank answers the same (the
        inputs are the scheduler's output and the configuration)."""
        return self.tp.world_size > 1 and (self.every_rank or verifying_hybrid)

    def share(self, tokens: StepTokens | None) -> StepTokens:
        """The driver's ``tokens`` on every rank (others pass None)."""
        shared = self.tp.broadcast_object(tokens if self.tp.is_driver else None)
        assert isinstance(shared, StepTokens)
        return shared


DRIVER_ONLY = SpecRanks()  # one rank: nothing to share
