"""The periodic engine log line (vLLM's "Avg prompt throughput ..." format)."""

from __future__ import annotations

import time
from collections.abc import Callable

from qwenserve.logger import init_logger
from qwenserve.metrics.stats import EngineStats, MultiModalCacheStats, SpecDecodingStats

logger = init_logger("qwenserve.engine")


class LoggingStatLogger:
    """Logs one line per engine (data-parallel rank) every ``interval_s`` while it works."""

    def __init__(self, interval_s: float = 10.0,
                 mm_cache: Callable[[], MultiModalCacheStats] | None = None) -> None:
        self.interval_s = interval_s
        # the processed-image cache's totals (set by the server once its image front exists);
        # one cache in the API process for all engines, so only the first engine's line shows it
        self.mm_cache = mm_cache
        self._engines: dict[int, _EngineLogger] = {}

    def record(self, stats: EngineStats) -> None:
        engine = self._engines.get(stats.engine_index)
        if engine is None:
            engine = self._engines[stats.engine_index] = _EngineLogger(
                self.interval_s, self._mm_stats if not self._engines else None)
        engine.record(stats)

    def _mm_stats(self) -> MultiModalCacheStats:
        return self.mm_cache() if self.mm_cache is not None else MultiModalCacheStats()


class _EngineLogger:
    """One engine's figures since its last line."""

    def __init__(self, interval_s: float,
                 mm_cache: Callable[[], MultiModalCacheStats] | None) -> None:
        self.interval_s = interval_s
        self.mm_cache = mm_cache
        self._last_mm = MultiModalCacheStats()
        self._last = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_queries = self._last_hits = 0
        self._spec = SpecDecodingStats()

    def record(self, stats: EngineStats) -> None:
        if stats.iteration.spec_decoding is not None:
            self._spec.merge(stats.iteration.spec_decoding)
        self._prompt_tokens += stats.iteration.num_prompt_tokens
        self._generation_tokens += stats.iteration.num_generation_tokens
        now = time.monotonic()
        elapsed = now - self._last
        if elapsed < self.interval_s:
            return
        queries = stats.prefix_cache_queries - self._last_queries
        hits = stats.prefix_cache_hits - self._last_hits
        line = ("Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: "
                "%.1f tokens/s, Running: %d reqs, Waiting: %d reqs, Preemptions: %d, "
                "KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%")
        args = [stats.engine_index, self._prompt_tokens / elapsed,
                self._generation_tokens / elapsed, stats.num_running, stats.num_waiting,
                stats.num_preemptions, stats.kv_cache_usage * 100,
                100.0 * hits / queries if queries else 0.0]
        mm = self.mm_cache() if self.mm_cache is not None else MultiModalCacheStats()
        if mm.queries:  # vLLM adds the image cache's rate once it has been queried
            mm_queries, mm_hits = mm.queries - self._last_mm.queries, mm.hits - self._last_mm.hits
            line += ", MM cache hit rate: %.1f%%"
            args.append(100.0 * mm_hits / mm_queries if mm_queries > 0 else 0.0)
        self._last_mm = mm
        logger.info(line, *args)
        if stats.iteration.spec_decoding is not None:
            self._log_spec_decoding(elapsed)
        self._last = now
        self._prompt_tokens = self._generation_tokens = 0
        self._last_queries, self._last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits

    def _log_spec_decoding(self, elapsed: float) -> None:
        """vLLM's "SpecDecoding metrics" line: mean acceptance length counts the token every
        verification emits, so it is 1 + accepted / drafts."""
        spec, self._spec = self._spec, SpecDecodingStats()
        if not spec.num_drafts:
            return
        per_pos = ", ".join(f"{n / spec.num_drafts:.3f}"
                            for n in spec.num_accepted_tokens_per_pos)
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f "
            "tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d "
            "tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1 + spec.num_accepted_tokens / spec.num_drafts,
            spec.num_accepted_tokens / elapsed, spec.num_draft_tokens / elapsed,
            spec.num_accepted_tokens, spec.num_draft_tokens, per_pos,
            100.0 * spec.num_accepted_tokens / max(spec.num_draft_tokens, 1))
