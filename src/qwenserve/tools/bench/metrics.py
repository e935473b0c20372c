"""Serving-benchmark figures, computed exactly as vLLM's ``vllm bench serve`` computes them.

Pure arithmetic on per-request timestamps: no I/O, no clock, no tokenizer. Keeping it pure is what
lets the tests check every figure against hand-computed values, and what makes our numbers
comparable with vLLM's (same definitions, same numpy estimators: ``np.std`` is the population
standard deviation and ``np.percentile`` uses linear interpolation, as in vLLM).

Definitions (vLLM ``vllm/benchmarks/serve.py``):

- TTFT: first SSE chunk carrying ``choices`` minus the send time.
- TPOT (per request): ``(E2EL - TTFT) / (output_tokens - 1)``, only when ``output_tokens > 1``.
- ITL: every gap between consecutive chunks carrying ``choices``, pooled over all requests.
- E2EL: last processed chunk minus the send time.
- Throughputs divide by the benchmark duration; only successful requests count.
- Goodput: successful requests meeting every SLO (``metric <= slo``); one-token requests have
  TPOT 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
# vLLM's client-side queueing figures: only under --max-concurrency, the second only at a finite
# request rate (with rate inf every request "arrives" at t=0, so the sum would be meaningless).
QUEUE_METRIC_NAMES = ("client_queue_time", "e2el_including_client_queue")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one request produced; the field names are vLLM's ``RequestFuncOutput``'s.

    Times are seconds. ``start_time`` is on the benchmark's clock (``time.perf_counter``).
    ``output_tokens`` is the server's ``usage.completion_tokens`` (0 when it sent no usage);
    ``prompt_len`` is the server's ``usage.prompt_tokens`` when it sent one, else the client's.
    ``client_queue_time`` is the wait for a ``--max-concurrency`` slot before the send.
    """

    success: bool = False
    prompt_len: int = 0
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""
    client_queue_time: float = 0.0


@dataclass(frozen=True)
class Stats:
    """Mean, median, population std and percentiles of one metric, all in milliseconds."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The run's figures; names follow vLLM's ``BenchmarkMetrics`` and result JSON."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    stats: dict[str, Stats]
    max_output_tokens_per_s: float
    max_concurrent_requests: int


def percentile_key(p: float) -> str:
    """vLLM's spelling of a percentile in keys and labels: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def summarize(values_s: list[float], percentiles: list[float]) -> Stats:
    """Summary in ms. An empty list summarises as zeros, as vLLM's ``np.mean(x or 0)`` does."""
    data = values_s or [0.0]
    return Stats(
        mean_ms=float(np.mean(data)) * 1000,
        median_ms=float(np.median(data)) * 1000,
        std_ms=float(np.std(data)) * 1000,
        percentiles_ms=tuple((p, float(np.percentile(data, p)) * 1000) for p in percentiles),
    )


def request_tpot(result: RequestResult, output_len: int) -> float | None:
    """Per-request TPOT in seconds, excluding the first token; None when it has < 2 tokens."""
    if output_len <= 1:
        return None
    return (result.latency - result.ttft) / (output_len - 1)


def count_good(ok: list[tuple[RequestResult, int]], goodput_ms: dict[str, float]) -> int:
    """Successful requests meeting every given SLO (``value <= slo``), vLLM's goodput rule."""
    if not goodput_ms:
        return 0
    good = 0
    for result, output_len in ok:
        values_s = {
            "ttft": result.ttft,
            "tpot": request_tpot(result, output_len) or 0.0,
            "e2el": result.latency,
        }
        if all(values_s[name] <= slo / 1000 for name, slo in goodput_ms.items()):
            good += 1
    return good


def token_times(result: RequestResult) -> list[float]:
    """Arrival time of every streamed chunk: start + TTFT, then + each ITL in turn."""
    times = [result.start_time + result.ttft]
    for gap in result.itl:
        times.append(times[-1] + gap)
    return times


def peak_output_tokens_per_s(ok: list[RequestResult]) -> float:
    """Most chunks arriving in any one-second bucket counted from the earliest start (vLLM).

    vLLM counts chunk timestamps, so it equals tokens per second only when each chunk holds one
    token; we keep its definition so the figure stays comparable.
    """
    if not ok:
        return 0.0
    t0 = min(r.start_time for r in ok)
    t_end = max(r.start_time + r.latency for r in ok)
    num_buckets = int(math.ceil(t_end - t0)) + 1
    buckets = np.zeros(num_buckets)
    for result in ok:
        for t in token_times(result):
            index = int(t - t0)
            if 0 <= index < num_buckets:
                buckets[index] += 1
    return float(np.max(buckets))


def peak_concurrency(ok: list[RequestResult]) -> int:
    """Most requests in flight at once over half-open intervals [start, start + E2EL)."""
    events = [(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok]
    events.sort()  # at equal times -1 sorts first: a departure frees its slot before an arrival
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def calculate_metrics(
    results: list[RequestResult],
    output_lens: list[int],
    duration_s: float,
    percentiles: list[float],
    goodput_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    """All figures of one measured run.

    ``output_lens[i]`` is request i's counted output tokens (0 for failed requests); the caller
    decides where counts come from (server usage or a tokenizer), see ``serve.py``.
    """
    ok = [(r, n) for r, n in zip(results, output_lens, strict=True) if r.success]
    ttfts = [r.ttft for r, _ in ok]
    e2els = [r.latency for r, _ in ok]
    itls = [gap for r, _ in ok for gap in r.itl]
    tpots = [t for t in (request_tpot(r, n) for r, n in ok) if t is not None]
    total_input = sum(r.prompt_len for r, _ in ok)
    total_output = sum(output_lens)
    successful = [r for r, _ in ok]
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / duration_s,
        request_goodput=count_good(ok, goodput_ms or {}) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        stats={
            "ttft": summarize(ttfts, percentiles),
            "tpot": summarize(tpots, percentiles),
            "itl": summarize(itls, percentiles),
            "e2el": summarize(e2els, percentiles),
        },
        max_output_tokens_per_s=peak_output_tokens_per_s(successful),
        max_concurrent_requests=peak_concurrency(successful),
    )


def queue_stats(
    results: list[RequestResult], percentiles: list[float], finite_rate: bool
) -> dict[str, Stats]:
    """vLLM's queueing figures over successful requests: the wait for a concurrency slot, and
    (at a finite rate) E2EL plus that wait, i.e. latency as the arriving user sees it."""
    ok = [r for r in results if r.success]
    stats = {"client_queue_time": summarize([r.client_queue_time for r in ok], percentiles)}
    if finite_rate:
        stats["e2el_including_client_queue"] = summarize(
            [r.latency + r.client_queue_time for r in ok], percentiles
        )
    return stats


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            slo = float(value)
        except ValueError:
            slo = math.nan
        if not sep or math.isnan(slo):
            raise ValueError(
                f"--goodput expects KEY:VALUE pairs in ms (e.g. ttft:500), got {pair!r}"
            )
        if name not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput metric {name!r} is not one of {', '.join(GOODPUT_METRICS)}"
            )
        if slo < 0:
            raise ValueError(f"--goodput value for {name} must be >= 0 ms, got {value}")
        slos[name] = slo
    return slos


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``, each in [0, 100] (vLLM and numpy allow 0)."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(
            f"--metric-percentiles expects numbers like 50,90,99, got {text!r}"
        ) from None
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles values must be in [0, 100], got {text!r}")
    return values


def parse_metric_names(text: str) -> list[str]:
    """``"ttft,tpot"`` -> ``["ttft", "tpot"]``; vLLM's names: ttft, tpot, itl, e2el and the two
    queueing figures (shown only under ``--max-concurrency``)."""
    allowed = METRIC_NAMES + QUEUE_METRIC_NAMES
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ValueError(f"--percentile-metrics accepts {','.join(allowed)}; got {text!r}")
    return names
