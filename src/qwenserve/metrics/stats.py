"""Plain statistics the engine produces each step; loggers (log line, Prometheus) consume them.

Plain data with no imports: the scheduler (``core/``) fills ``SchedulerStats`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort"
    e2e_latency_s: float
    queue_time_s: float
    prefill_time_s: float
    decode_time_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int | None
    n: int = 1


@dataclass
class IterationStats:
    """What happened in one engine step."""

    num_prompt_tokens: int = 0  # prompts of requests that produced their first token
    num_generation_tokens: int = 0
    num_scheduled_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class SchedulerStats:
    """Scheduler gauges and cumulative counters at the end of a step (``Scheduler.stats()``)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


@dataclass
class EngineStats(SchedulerStats):
    """What the stat loggers receive each step: the scheduler's figures and the step's."""

    iteration: IterationStats
