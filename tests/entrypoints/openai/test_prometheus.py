"""The metric table and PrometheusStatLogger without a server."""

from __future__ import annotations

from prometheus_client import generate_latest

from qwenserve.metrics.prometheus import (
    EXPORTED_METRICS,
    HIDDEN_METRICS,
    METRICS,
    PrometheusStatLogger,
    build_1_2_5_buckets,
    make_registry,
)
from qwenserve.metrics.stats import EngineStats, FinishedRequestStats, IterationStats


def stats(queries: int, hits: int, preemptions: int, **iteration) -> EngineStats:
    return EngineStats(2, 1, 0.25, queries, hits, preemptions, IterationStats(**iteration))


def value(registry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})


def test_names_are_vllms_and_unique():
    assert len(set(EXPORTED_METRICS)) == len(EXPORTED_METRICS)
    assert all(n.startswith("vllm:") for n in EXPORTED_METRICS)
    counters = {m.exposed_name for m in METRICS if m.kind == "counter"}
    assert all(n.endswith("_total") for n in counters)
    assert "vllm:gpu_cache_usage_perc" in HIDDEN_METRICS
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


def test_cumulative_engine_counters_become_increments():
    registry = make_registry(process_metrics=False)
    logger = PrometheusStatLogger(registry, "m", 1024)
    logger.record(
        stats(
            100,
            40,
            1,
            num_prompt_tokens=10,
            num_generation_tokens=3,
            num_scheduled_tokens=13,
            ttfts_s=[0.02],
            itls_s=[0.01, 0.01],
        )
    )
    logger.record(stats(150, 60, 1, num_generation_tokens=2, num_scheduled_tokens=2))
    assert value(registry, "vllm:prefix_cache_queries_total") == 150
    assert value(registry, "vllm:prefix_cache_hits_total") == 60
    assert value(registry, "vllm:num_preemptions_total") == 1
    assert value(registry, "vllm:generation_tokens_total") == 5
    assert value(registry, "vllm:kv_cache_usage_perc") == 0.25
    assert value(registry, "vllm:iteration_tokens_total_count") == 2
    logger.record(stats(10, 5, 0))  # the engine's totals were reset: a new baseline
    assert value(registry, "vllm:prefix_cache_queries_total") == 150
    logger.record(stats(30, 5, 0))
    assert value(registry, "vllm:prefix_cache_queries_total") == 170


def test_finished_requests_and_hidden_metrics():
    registry = make_registry(process_metrics=False)
    logger = PrometheusStatLogger(registry, "m", 1024, show_hidden=True)
    done = FinishedRequestStats("length", 1.0, 0.1, 0.2, 0.7, 12, 8, 8)
    logger.record(
        stats(
            0,
            0,
            0,
            finished=[done, FinishedRequestStats("abort", 0.5, 0.5, 0, 0, 12, 0, 8)],
            itls_s=[0.1],
        )
    )
    assert value(registry, "vllm:request_success_total", finished_reason="length") == 1
    assert value(registry, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(registry, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(registry, "vllm:e2e_request_latency_seconds_count") == 2
    assert abs(value(registry, "vllm:request_time_per_output_token_seconds_sum") - 0.1) < 1e-9
    assert value(registry, "vllm:gpu_cache_usage_perc") == 0.25
    assert value(registry, "vllm:time_per_output_token_seconds_count") == 1
    text = generate_latest(registry).decode()
    assert 'vllm:request_prompt_tokens_bucket{engine="0",le="1000.0",model_name="m"}' in text


def test_two_servers_in_one_process_do_not_clash():
    """Each logger registers on its own registry (no duplicate-timeseries error from the global
    one), and what one records does not show in the other."""
    registries = [make_registry() for _ in range(2)]
    loggers = [PrometheusStatLogger(r, "m", 64) for r in registries]
    loggers[0].record(stats(10, 4, 0, num_generation_tokens=3))
    loggers[1].record(stats(20, 5, 2, num_generation_tokens=7))
    assert value(registries[0], "vllm:generation_tokens_total") == 3
    assert value(registries[1], "vllm:generation_tokens_total") == 7
    assert value(registries[0], "vllm:num_preemptions_total") == 0
    assert value(registries[1], "vllm:prefix_cache_hits_total") == 5


def test_image_cache_totals_become_vllms_mm_cache_counters():
    """``vllm:mm_cache_queries`` / ``_hits`` (in images) follow the processed-image cache's
    running totals, read from where the cache lives at each step; zero without a cache."""
    from qwenserve.metrics.stats import MultiModalCacheStats

    totals = MultiModalCacheStats()

    def source() -> MultiModalCacheStats:
        return totals

    registry = make_registry(process_metrics=False)
    logger = PrometheusStatLogger(registry, "m", 1024, mm_cache=source)
    logger.record(stats(0, 0, 0))
    assert value(registry, "vllm:mm_cache_queries_total") == 0
    totals = MultiModalCacheStats(queries=3, hits=1)
    logger.record(stats(0, 0, 0))
    totals = MultiModalCacheStats(queries=5, hits=2)
    logger.record(stats(0, 0, 0))
    assert value(registry, "vllm:mm_cache_queries_total") == 5
    assert value(registry, "vllm:mm_cache_hits_total") == 2
    plain = make_registry(process_metrics=False)
    PrometheusStatLogger(plain, "m", 1024).record(stats(0, 0, 0))  # a text model: zeros
    assert value(plain, "vllm:mm_cache_queries_total") == 0


def test_log_line_adds_the_mm_cache_hit_rate_once_queried(caplog):
    import logging

    from qwenserve.metrics.loggers import LoggingStatLogger
    from qwenserve.metrics.stats import MultiModalCacheStats

    totals = [MultiModalCacheStats()]
    line = LoggingStatLogger(interval_s=0.0, mm_cache=lambda: totals[0])
    engine_log = logging.getLogger("qwenserve.engine")  # qwenserve's loggers do not propagate
    engine_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="qwenserve.engine"):
            line.record(stats(0, 0, 0))
            totals[0] = MultiModalCacheStats(queries=4, hits=1)
            line.record(stats(0, 0, 0))
    finally:
        engine_log.removeHandler(caplog.handler)
    # (a record may reach caplog twice, by this handler and by propagation: order is what counts)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Engine 000")]
    assert "MM cache" not in lines[0]  # vLLM shows it once the cache has been queried
    assert lines[-1].endswith("MM cache hit rate: 25.0%")
