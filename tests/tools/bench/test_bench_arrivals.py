"""The arrival process: mean rate, burstiness, vLLM's draws and the pacing of sends."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from qwenserve.tools.bench.arrivals import arrival_times, paced

N = 20_000


def gaps(times: list[float]) -> np.ndarray:
    return np.diff([0.0, *times])


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_rate_and_burstiness(burstiness: float) -> None:
    rate = 10.0
    times = arrival_times(N, rate, burstiness, seed=1)
    g = gaps(times)
    assert times[-1] == pytest.approx(N / rate)  # vLLM rescales to exactly N / rate
    assert g.mean() == pytest.approx(1 / rate, rel=1e-9)
    # gamma(k, theta): coefficient of variation 1 / sqrt(k)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert (g >= 0).all()


def test_poisson_gap_distribution() -> None:
    g = gaps(arrival_times(N, 5.0, 1.0, seed=3))
    # exponential gaps: P(gap < mean) = 1 - 1/e
    assert (g < g.mean()).mean() == pytest.approx(1 - math.exp(-1), abs=0.015)


def test_same_draws_as_vllm() -> None:
    """vLLM: np.random.seed(seed); np.random.gamma(shape=b, scale=1/(rate*b)) per request."""
    rate, burstiness, seed, n = 3.0, 0.5, 42, 50
    np.random.seed(seed)
    raw = np.cumsum(
        [np.random.gamma(shape=burstiness, scale=1 / (rate * burstiness)) for _ in range(n)]
    )
    expected = raw * (n / rate) / raw[-1]
    assert arrival_times(n, rate, burstiness, seed) == pytest.approx(expected.tolist())


def test_seeded_inf_and_constant() -> None:
    assert arrival_times(100, 2.0, 1.0, seed=7) == arrival_times(100, 2.0, 1.0, seed=7)
    assert arrival_times(100, 2.0, 1.0, seed=7) != arrival_times(100, 2.0, 1.0, seed=8)
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(4, 2.0, math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert arrival_times(0, 1.0) == []
    for rate, b in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_times(3, rate, b)


def test_paced_never_early() -> None:
    async def collect() -> list[tuple[str, float]]:
        start = time.perf_counter()
        return [
            (item, time.perf_counter() - start) async for item in paced("abc", [0.0, 0.05, 0.1])
        ]

    got = asyncio.run(collect())
    assert [item for item, _ in got] == ["a", "b", "c"]
    for (_, at), target in zip(got, [0.0, 0.05, 0.1], strict=True):
        assert target <= at + 1e-3 < target + 0.04
