"""The lock-step message's fixed layout (``spec_decode/lockstep.py``) round-trips on one rank;
across two ranks it is exercised by ``test_spec_tp.py``."""

from __future__ import annotations

from qwenserve.core.sched_output import ScheduledChunk
from qwenserve.distributed.parallel_group import SINGLE, ParallelGroup
from qwenserve.spec_decode.lockstep import SpecRanks, StepTokens


def test_layout_round_trips():
    sampled = [ScheduledChunk("a", [1, 2, 3, 4], 7, [], True, 3),  # 3 drafts, 1 accepted
               ScheduledChunk("b", [9], 4, [], True),  # a plain decode
               ScheduledChunk("c", [5, 6, 0], 2, [], True, 2)]  # all accepted; token id 0
    tokens = StepTokens([[3, 11], [12], [6, 0, 13]], ["a", "c"])
    assert SpecRanks(SINGLE, True).share(sampled, tokens) == tokens
    assert SpecRanks(SINGLE, True).share([], None) == StepTokens()


def test_only_multi_rank_steps_share():
    two = ParallelGroup(rank=0, world_size=2)
    assert not SpecRanks(SINGLE, True).must_share(True)
    assert SpecRanks(two, True).must_share(False)  # a sharded head: every step
    assert SpecRanks(two, False).must_share(True)  # a hybrid target verifying drafts
    assert not SpecRanks(two, False).must_share(False)  # n-gram on a dense target
