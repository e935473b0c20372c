"""``LockstepPasses`` on gloo processes (2 replicas, DP x EP): replicas whose steps run different
MoE work (one idle, one recomputing a rollback, MTP heads running fewer passes than k) still
meet in every collective, and every real pass gets the whole layer's output. A pass left
unpadded would leave the other replica waiting in a collective: the queue's timeout turns that
hang into a failure."""

from __future__ import annotations

import multiprocessing as mp
import queue

import torch
from torch import nn

from helpers.moe_blocks import CFG, sharded_like, whole_block
from qwenserve.distributed.init import LOOPBACK, serve_store

K = 3  # head passes a step
# Per replica, per step: (tokens, rolls back, head passes run) or None (nothing scheduled).
STEPS = {0: [(3, True, 3), (2, False, 1), None, (1, True, 0)],
         1: [None, (4, True, 0), (2, False, 2), (5, False, 3)]}


def inputs(rank: int, step: int, n: int) -> torch.Tensor:
    torch.manual_seed(100 * rank + step)
    return torch.randn(n, CFG.hidden_size)


def scripted_proposer(head: nn.Module):
    """An MTP proposer whose drafting runs a scripted number of head passes on ``x``."""
    from qwenserve.spec_decode.mtp import MtpProposer

    class Scripted(MtpProposer):
        def _propose(self, request_ids, requests):
            for _ in range(self.script):
                self.head_passes += 1
                self.outs.append(self.head(self.x))
            return {}

    return Scripted(head, None, None, 16, torch.device("cpu"), K, 128)


def replica(rank: int, port: int, results) -> None:
    from qwenserve.distributed.init import join_data_parallel_groups, leave_parallel_group
    from qwenserve.worker.dp_passes import LockstepPasses

    torch.set_num_threads(1)
    groups = join_data_parallel_groups("gloo", rank, 2, 1, 0, LOOPBACK, port)
    try:
        target = nn.Sequential(sharded_like(whole_block(0), groups.tp, groups.moe))
        head = nn.Sequential(sharded_like(whole_block(1), groups.tp, groups.moe))
        mtp = scripted_proposer(head)
        passes = LockstepPasses(groups.moe, target, vote_rollback=True, mtp=mtp)
        outs = mtp.outs = []
        with torch.no_grad():
            for step, work in enumerate(STEPS[rank]):
                if work is None:
                    passes.idle_step()
                    continue
                n, rolls_back, head_passes = work
                x = inputs(rank, step, n)
                outs.append(target(x))
                passes.rollback(rolls_back)
                if rolls_back:
                    outs.append(target(x[:1]))
                mtp.x, mtp.script = x, head_passes
                assert mtp.propose([], {}) == {} and mtp.head_passes == head_passes
        results.put((rank, [o.numpy() for o in outs]))
    finally:
        leave_parallel_group(groups.moe)


def test_unequal_steps_meet_in_every_collective():
    store, port = serve_store(2)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=replica, args=(r, port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=90) for _ in procs)
    except queue.Empty:
        raise AssertionError("a replica waited in a collective the other never entered") \
            from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    target, head = whole_block(0), whole_block(1)
    with torch.no_grad():
        for rank, outs in got.items():
            want = []
            for step, work in enumerate(STEPS[rank]):
                if work is not None:
                    n, rolls_back, head_passes = work
                    x = inputs(rank, step, n)
                    want += [target(x)] + [target(x[:1])] * rolls_back + [head(x)] * head_passes
            assert len(outs) == len(want)
            for out, ref in zip(map(torch.from_numpy, outs), want):
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    del store
