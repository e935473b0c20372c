"""The periodic engine log line (vLLM's "Avg prompt throughput ..." format)."""

from __future__ import annotations

import time

from qwenserve.logger import init_logger
from qwenserve.metrics.stats import EngineStats

logger = init_logger("qwenserve.engine")


class LoggingStatLogger:
    """Logs throughput, queue and cache figures every ``interval_s`` while the engine works."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_queries = self._last_hits = 0

    def record(self, stats: EngineStats) -> None:
        self._prompt_tokens += stats.iteration.num_prompt_tokens
        self._generation_tokens += stats.iteration.num_generation_tokens
        now = time.monotonic()
        elapsed = now - self._last
        if elapsed < self.interval_s:
            return
        queries = stats.prefix_cache_queries - self._last_queries
        hits = stats.prefix_cache_hits - self._last_hits
        logger.info(
            "Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: "
            "%.1f tokens/s, Running: %d reqs, Waiting: %d reqs, Preemptions: %d, "
            "KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            self._prompt_tokens / elapsed, self._generation_tokens / elapsed,
            stats.num_running, stats.num_waiting, stats.num_preemptions,
            stats.kv_cache_usage * 100, 100.0 * hits / queries if queries else 0.0)
        self._last = now
        self._prompt_tokens = self._generation_tokens = 0
        self._last_queries, self._last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
