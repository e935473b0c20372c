"""The MoE exchange over data-parallel replicas (DP x EP), on gloo processes (2 replicas x 1 or
2 tensor-parallel ranks): each replica's tokens, whatever their count (zero for an idle
replica), get the same output as the whole layer on one device."""

from __future__ import annotations

import multiprocessing as mp
from types import SimpleNamespace

import pytest
import torch

from qwenserve.distributed.init import LOOPBACK, serve_store
from qwenserve.distributed.parallel_group import SINGLE
from qwenserve.layers.moe import MoEBlock

CFG = SimpleNamespace(num_experts=5, num_experts_per_tok=2, hidden_size=16,
                      moe_intermediate_size=8, norm_topk_prob=True)
TOKENS = {0: [3, 0, 4], 1: [0, 0, 6]}  # per step: rank 0 idle once, rank 1 twice


def whole_block() -> MoEBlock:
    torch.manual_seed(0)
    block = MoEBlock(CFG, torch.float32, SINGLE, shared_intermediate_size=8)
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    return block


def sharded_like(full: MoEBlock, tp, dp_ep) -> MoEBlock:
    block = MoEBlock(CFG, torch.float32, tp, shared_intermediate_size=8, dp_ep=dp_ep)
    for mine, whole in ((block.experts, full.experts), (block.shared_expert, full.shared_expert)):
        inter = whole.intermediate_size
        for e in range(whole.num_experts):
            mine.load_expert(e, "gate", whole.w13[e, :inter])
            mine.load_expert(e, "up", whole.w13[e, inter:])
            mine.load_expert(e, "down", whole.w2[e])
    block.shared_expert_gate.load_state_dict(full.shared_expert_gate.state_dict())
    block.gate.load_state_dict(full.gate.state_dict())
    return block


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
