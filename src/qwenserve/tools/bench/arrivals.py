"""Request arrival times, drawn exactly as vLLM's ``get_request`` draws them.

Gaps between arrivals follow a gamma distribution with shape = burstiness and
scale = 1 / (rate * burstiness), so the mean gap is 1 / rate for every burstiness; burstiness 1 is
a Poisson process, < 1 burstier, > 1 more even. As in vLLM, the cumulative times are then rescaled
so the last request is sent at exactly ``num_requests / rate``: otherwise the sampled total drifts
by a few percent and throughput figures wobble from seed to seed.

Seeding: vLLM calls ``np.random.seed(seed)`` and then draws from the global generator; a fresh
``np.random.RandomState(seed)`` yields the same numbers without touching global state, so the same
``--seed`` gives the same schedule as ``vllm bench serve``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def arrival_times(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send time of each request in seconds after the start of the run.

    ``request_rate = inf`` sends everything at t = 0. ``burstiness = inf`` gives constant gaps.
    """
    if num_requests <= 0:
        return []
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = [1.0 / request_rate] * num_requests
    else:
        rng = np.random.RandomState(seed)
        theta = 1.0 / (request_rate * burstiness)
        gaps = [float(rng.gamma(shape=burstiness, scale=theta)) for _ in range(num_requests)]
    times = list(np.cumsum(gaps))
    if times[-1] != 0:
        scale = (num_requests / request_rate) / times[-1]
        times = [float(t * scale) for t in times]
    return times


async def paced(items: Sequence[T], times_s: Sequence[float]) -> AsyncIterator[T]:
    """Yield ``items[i]`` at ``times_s[i]`` after the first call, never early.

    Like vLLM, a late item is yielded at once rather than shifting the rest of the schedule.
    """
    start = time.perf_counter()
    for item, at_s in zip(items, times_s, strict=True):
        delay = start + at_s - time.perf_counter()
        if at_s > 0 and delay > 0:
            await asyncio.sleep(delay)
        yield item
