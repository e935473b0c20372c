"""The KV-head plan between different tensor-parallel sizes: every head a consumer rank needs
comes from a producer rank that holds it, and every producer rank is contacted exactly as
often as it is told to expect."""

from __future__ import annotations

import pytest

from qwenserve.kv_transfer.heads import kv_heads, pull_plan


@pytest.mark.parametrize("num_kv, tp_p, tp_c", [(4, 8, 4), (4, 4, 8), (8, 2, 4), (8, 4, 2),
                                                 (2, 8, 1), (4, 2, 2), (1, 4, 2)])
def test_plan_covers_heads_and_every_producer_rank(num_kv, tp_p, tp_c):
    contacts = {p: 0 for p in range(tp_p)}
    for c in range(tp_c):
        got = {}
        for part in pull_plan(c, tp_c, tp_p, num_kv):
            contacts[part.remote_rank] += 1
            held = kv_heads(part.remote_rank, tp_p, num_kv)
            for s, d in zip(part.src, part.dst, strict=True):
                got[d] = held[s]
        assert [got[d] for d in sorted(got)] == kv_heads(c, tp_c, num_kv)
    for c in range(tp_c):
        for part in pull_plan(c, tp_c, tp_p, num_kv):
            assert part.expect == contacts[part.remote_rank] >= 1
    assert all(n >= 1 for n in contacts.values())


def test_same_tp_is_rank_to_rank():
    assert [(p.remote_rank, p.src, p.dst, p.expect) for p in pull_plan(1, 2, 2, 4)] == [
        (1, [0, 1], [0, 1], 1)]
