"""The MoE exchange over data-parallel replicas (DP x EP), on gloo processes (2 replicas x 1 or
2 tensor-parallel ranks): each replica's tokens, whatever their count (zero for an idle
replica), get the same output as the whole layer on one device."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from helpers.moe_blocks import CFG, sharded_like, whole_block
from qwenserve.distributed.init import LOOPBACK, serve_store

TOKENS = {0: [3, 0, 4], 1: [0, 0, 6]}  # per step: rank 0 idle once, rank 1 twice


def inputs(rank: int, step: int) -> torch.Tensor:
    torch.manual_seed(100 * rank + step)
    return torch.randn(TOKENS[rank][step], CFG.hidden_size)


def replica(rank: int, tp_size: int, tp_rank: int, port: int, results) -> None:
    from qwenserve.distributed.init import join_data_parallel_groups, leave_parallel_group

    torch.set_num_threads(1)
    groups = join_data_parallel_groups("gloo", rank, 2, tp_size, tp_rank, LOOPBACK, port)
    try:
        block = sharded_like(whole_block(), groups.tp, groups.moe)
        held = block.experts.w13.shape[0]
        outs = []
        with torch.no_grad():
            for step in range(len(TOKENS[rank])):
                x = inputs(rank, step)
                if len(x):
                    outs.append(block(x))
                else:
                    block.run_idle()
                    outs.append(x)
        # as numpy: tensors would travel as shared memory, gone once this process exits
        results.put(((rank, tp_rank), held, [o.numpy() for o in outs]))
    finally:
        leave_parallel_group(groups.moe)


@pytest.mark.parametrize("tp_size, held", [(1, [3, 2]), (2, [2, 1, 1, 1])])
def test_each_replica_gets_the_whole_layers_output(tp_size, held):
    store, port = serve_store(2 * tp_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=replica, args=(r, tp_size, t, port, results))
             for r in (0, 1) for t in range(tp_size)]
    for p in procs:
        p.start()
    got = dict((where, (n, outs)) for where, n, outs in
               (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    full = whole_block()
    assert [got[k][0] for k in sorted(got)] == held  # whole experts: 5 over every rank
    with torch.no_grad():
        for (rank, _), (_, outs) in got.items():
            for step, out in enumerate(map(torch.from_numpy, outs)):
                x = inputs(rank, step)
                assert out.shape == x.shape
                if len(x):
                    torch.testing.assert_close(out, full(x), rtol=1e-5, atol=1e-5)
    del store
