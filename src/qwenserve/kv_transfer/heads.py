"""Which producer rank serves which KV heads to which consumer rank, when prefill and decode run
different tensor-parallel sizes (the guides' prefill tp 8 / decode tp 4). No torch.

A rank holds KV heads as the QKV projection splits them: ``num_kv // tp`` consecutive heads
when there are at least as many heads as ranks, else one head, ``rank * num_kv // tp``, shared
by ``tp // num_kv`` ranks. Consumer rank c needs its heads; each comes from the first producer
rank that holds it. Every producer rank must hear from some consumer rank, or its hold would
never be released: rank p is also contacted by consumer rank ``p % tp_c`` (with no heads when
it needs none there), and each pull request says how many pulls that producer rank will get.

    num_kv 4, prefill tp 8 -> decode tp 4:  decode rank 1 needs head 1, held by prefill ranks
    2 and 3: pulls it from 2, and pings 5 (5 % 4 == 1) so that 5's hold is released too.
"""

from __future__ import annotations

from dataclasses import dataclass


def kv_heads(rank: int, tp: int, num_kv: int) -> list[int]:
    """The global KV heads tensor-parallel ``rank`` of ``tp`` holds, in its local order."""
    if tp <= num_kv:
        per = num_kv // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * num_kv // tp]


@dataclass(frozen=True)
class PullPart:
    """One request to one producer rank: its local heads ``src`` -> our local heads ``dst``
    (both empty: a release-only ping), and how many pulls that rank receives in all."""

    remote_rank: int
    src: list[int]
    dst: list[int]
    expect: int


def _parts(rank: int, tp: int, remote_tp: int, num_kv: int) -> dict[int, tuple[list, list]]:
    parts: dict[int, tuple[list[int], list[int]]] = {}
    for dst, head in enumerate(kv_heads(rank, tp, num_kv)):
        owner = next(p for p in range(remote_tp) if head in kv_heads(p, remote_tp, num_kv))
        src, dsts = parts.setdefault(owner, ([], []))
        src.append(kv_heads(owner, remote_tp, num_kv).index(head))
        dsts.append(dst)
    for p in range(rank, remote_tp, tp):  # release duty for the ranks nobody else pulls from
        parts.setdefault(p, ([], []))
    return parts


def pull_plan(rank: int, tp: int, remote_tp: int, num_kv: int) -> list[PullPart]:
    """What consumer ``rank`` (of ``tp``) asks of a producer running ``remote_tp`` ranks."""
    every = [_parts(c, tp, remote_tp, num_kv) for c in range(tp)]
    return [PullPart(p, src, dst, sum(p in parts for parts in every))
            for p, (src, dst) in sorted(every[rank].items())]
