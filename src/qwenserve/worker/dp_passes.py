"""DP x EP: every replica runs the same MoE-collective passes each step, whatever it has to do.

Each MoE layer's forward is a collective over all replicas (``layers/moe.py``), so the replicas
must call their MoE layers the same number of times, in the same order, every step. Without
speculative decoding a step is one target forward (an idle replica runs it on zero tokens).
With it a step may run more, so its schedule is fixed, the same on every replica::

    1. the target's forward                       zero tokens where this replica has no step
    2. hybrid models with speculation: one vote (a 1-int all-reduce) "does a replica roll back
       a rejected draft?"; if one does, every replica runs the target's forward again: the
       recompute over the kept tokens (runner), or zero tokens
    3. MTP heads: exactly ``num_speculative_tokens`` head passes, the head's MoE layer
       included: catch-up + k - 1 drafts, each real or zero-token (``MtpProposer.propose``
       pads its own passes when ``lockstep`` is set; an idle step runs them all here)

Nothing that differs between replicas (which requests were drafted or accepted, requests at
their block limit, ``disable_by_batch_size``, a step of prefill chunks only, no requests at
all) changes this count, so no replica waits in a collective the others never enter; only (2)
needs agreement, and it costs one small all-reduce per step. Dense heads (EAGLE-3) and draft
models have no MoE exchange and pad nothing.
"""

from __future__ import annotations

from torch import nn

from qwenserve.distributed.parallel_group import ParallelGroup
from qwenserve.layers.moe import run_idle_moe
from qwenserve.spec_decode.mtp import MtpProposer


class LockstepPasses:
    def __init__(self, group: ParallelGroup, model: nn.Module, vote_rollback: bool = False,
                 mtp: MtpProposer | None = None) -> None:
        self.group = group  # the MoE group over every replica's ranks
        self.model = model
        self.vote_rollback = vote_rollback  # hybrid model with speculation: step 2 exists
        self.mtp = mtp  # step 3 exists
        if mtp is not None:
            mtp.lockstep = True

    def idle_step(self) -> None:
        """This replica's share of a step it has nothing scheduled in (1, 2 and 3 idle)."""
        run_idle_moe(self.model)
        self.rollback(False)
        if self.mtp is not None:
            self.mtp.idle_passes(self.mtp.num_tokens)

    def rollback(self, mine: bool) -> None:
        """Step 2 (before the recompute, which the caller runs when ``mine``): a replica with
        nothing to recompute runs the pass on zero tokens when another recomputes."""
        if not self.vote_rollback:
            return
        anyone = self.group.max_flags([int(mine)])[0]
        if anyone and not mine:
            run_idle_moe(self.model)
