"""The load generator: warm-up, then the measured window, with vLLM's pacing and concurrency cap.

Warm-up requests exist because the first requests a fresh server sees pay for operator compilation,
graph capture and cache allocation; they run to completion before the measured window opens and
none of their numbers reach any figure. The measured window starts just before the first send and
ends when the last response is complete, as vLLM's ``benchmark_duration``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from tqdm import tqdm

from qwenserve.tools.bench.arrivals import arrival_times, paced
from qwenserve.tools.bench.client import RequestSpec, send_request
from qwenserve.tools.bench.datasets import SampleRequest
from qwenserve.tools.bench.errors import BenchError
from qwenserve.tools.bench.metrics import RequestResult


@dataclass(frozen=True)
class LoadSpec:
    """The traffic of one measured run."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None

    def label(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        conc = f", max concurrency {self.max_concurrency}" if self.max_concurrency else ""
        return f"request rate {rate}{conc}"


@dataclass(frozen=True)
class Target:
    """Where and how to send: one value shared by every request of a run."""

    api_url: str
    model: str
    chat: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)

    def request(self, sample: SampleRequest) -> RequestSpec:
        return RequestSpec(
            api_url=self.api_url,
            model=self.model,
            prompt=sample.prompt,
            prompt_len=sample.prompt_len,
            output_len=sample.expected_output_len,
            chat=self.chat,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            headers=self.headers,
            extra_body=self.extra_body,
            request_id=sample.request_id,
        )


@dataclass
class RunOutput:
    """Raw outcome of one run; ``results`` are in dataset order, start times run-relative."""

    results: list[RequestResult]
    duration_s: float
    warmup: list[RequestResult]


def make_client(max_concurrency: int | None) -> httpx.AsyncClient:
    """A keep-alive client with no pool limit unless the run caps concurrency (as vLLM's).

    httpx's default pool (100 connections) would otherwise queue requests client-side while their
    clocks run, inflating TTFT under an unlimited request rate.
    """
    limits = httpx.Limits(
        max_connections=max_concurrency, max_keepalive_connections=max_concurrency
    )
    timeout = httpx.Timeout(6 * 3600.0, connect=30.0, pool=None)
    return httpx.AsyncClient(limits=limits, timeout=timeout)


async def run_load(
    target: Target,
    measured: list[SampleRequest],
    warmup: list[SampleRequest],
    load: LoadSpec,
    seed: int = 0,
    show_progress: bool = True,
) -> RunOutput:
    """Warm up, then send ``measured`` on the arrival schedule and gather every result."""
    async with make_client(load.max_concurrency) as client:
        warm = await _run_warmup(client, target, warmup, load.max_concurrency, show_progress)
        results, duration_s = await _run_measured(
            client, target, measured, load, seed, show_progress
        )
    return RunOutput(results=results, duration_s=duration_s, warmup=warm)


def _limiter(max_concurrency: int | None) -> Any:
    return asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()


async def _run_warmup(
    client: httpx.AsyncClient,
    target: Target,
    warmup: list[SampleRequest],
    max_concurrency: int | None,
    show_progress: bool,
) -> list[RequestResult]:
    """All warm-up requests at once (under the cap); a warm-up that fails entirely stops the run."""
    if not warmup:
        return []
    limiter = _limiter(max_concurrency)
    bar = tqdm(total=len(warmup), desc="Warm-up", unit="req", disable=not show_progress)

    async def one(sample: SampleRequest) -> RequestResult:
        async with limiter:
            result = await send_request(client, target.request(sample))
        bar.update(1)
        return result

    results = list(await asyncio.gather(*(one(s) for s in warmup)))
    bar.close()
    if not any(r.success for r in results):
        raise BenchError(f"all {len(results)} warm-up requests failed: {results[0].error}")
    return results


async def _run_measured(
    client: httpx.AsyncClient,
    target: Target,
    measured: list[SampleRequest],
    load: LoadSpec,
    seed: int,
    show_progress: bool,
) -> tuple[list[RequestResult], float]:
    times_s = arrival_times(len(measured), load.request_rate, load.burstiness, seed)
    limiter = _limiter(load.max_concurrency)
    bar = tqdm(total=len(measured), desc="Benchmark", unit="req", disable=not show_progress)

    async def one(sample: SampleRequest) -> RequestResult:
        arrival = time.perf_counter()
        async with limiter:
            result = await send_request(client, target.request(sample))
        # start_time stays the send time (throughput figures use it); the wait is kept apart
        result.client_queue_time = result.start_time - arrival
        bar.update(1)
        return result

    start = time.perf_counter()
    tasks = [asyncio.create_task(one(sample)) async for sample in paced(measured, times_s)]
    results = list(await asyncio.gather(*tasks))
    duration_s = time.perf_counter() - start
    bar.close()
    return [replace(r, start_time=r.start_time - start) for r in results], duration_s
