"""The Prometheus metrics qwenserve exports, in one place for the dashboard, alerts and tests.

Names and types follow vLLM's V1 ``PrometheusStatLogger`` (labels ``model_name`` and ``engine``),
so dashboards built for ``vllm serve`` keep working. Counters carry their ``_total`` suffix as
exposed; histograms are queried through ``_bucket``/``_sum``/``_count``. When the server's own
metric table (``qwenserve.metrics.prometheus``) exists it becomes the source of truth and the
deploy tests compare this list against it.
"""

from __future__ import annotations

GAUGES: tuple[str, ...] = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",  # fraction 0-1
)

COUNTERS: tuple[str, ...] = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",  # label finished_reason
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
)

HISTOGRAMS: tuple[str, ...] = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total",  # a histogram despite the suffix, as in vLLM
)

EXPORTED_METRICS: tuple[str, ...] = GAUGES + COUNTERS + HISTOGRAMS
HISTOGRAM_SUFFIXES: tuple[str, ...] = ("_bucket", "_sum", "_count")


def series_names() -> frozenset[str]:
    """Every series name a query may use: gauges, counters and the histograms' three series."""
    histogram_series = {h + s for h in HISTOGRAMS for s in HISTOGRAM_SUFFIXES}
    return frozenset(GAUGES + COUNTERS) | histogram_series
