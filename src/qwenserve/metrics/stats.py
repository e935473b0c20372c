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
class SpecDecodingStats:
    """Speculative-decoding counters (vLLM's ``SpecDecodingStats``)."""

    num_drafts: int = 0  # verified requests with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted tokens by draft position: index j counts drafts whose token j was accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend(
                [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos)))
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    def merge(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for pos, count in enumerate(other.num_accepted_tokens_per_pos):
            if pos == len(self.num_accepted_tokens_per_pos):
                self.num_accepted_tokens_per_pos.append(0)
            self.num_accepted_tokens_per_pos[pos] += count


@dataclass
class IterationStats:
    """What happened in one engine step."""

    num_prompt_tokens: int = 0  # prompts of requests that produced their first token
    num_generation_tokens: int = 0
    num_scheduled_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    spec_decoding: SpecDecodingStats | None = None  # verified drafts; None: not speculating


@dataclass(frozen=True)
class MultiModalCacheStats:
    """Running totals of the processed-image cache (``--mm-processor-cache-gb``), in images:
    ``vllm:mm_cache_queries`` / ``vllm:mm_cache_hits``. The cache sits where images are
    processed (the API process), not in the engine core, so its figures come from there."""

    queries: int = 0
    hits: int = 0


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
    """What the stat loggers receive each step: the scheduler's figures and the step's.
    ``engine_index``: the data-parallel rank that produced them (vLLM's ``engine`` label)."""

    iteration: IterationStats
    engine_index: int = 0
