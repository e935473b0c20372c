"""Prometheus metrics with vLLM's names, types, labels and buckets, in ONE table.

An existing vLLM Grafana dashboard or alert rule must work unchanged, so every metric here is
named as vLLM's V1 ``PrometheusStatLogger`` names it and carries the labels ``model_name`` (the
first served name) and ``engine`` (the data-parallel rank: "0" with one engine). Counters are
declared without ``_total``; ``prometheus_client`` adds it when exposing them. ``EXPORTED_METRICS`` lists the exposed names
(what a PromQL query uses) for the dashboard generator and the tests.

Each server owns a ``CollectorRegistry`` (never the global one), so several servers can live in
one process (tests do that). ``record`` runs on the engine thread; ``prometheus_client`` is
thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qwenserve import envs
from qwenserve.metrics.stats import (
    EngineStats,
    FinishedRequestStats,
    MultiModalCacheStats,
    SpecDecodingStats,
)

# the processed-image cache's running totals, read where the cache lives (the API process)
MultiModalCacheSource = Callable[[], MultiModalCacheStats]

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")
LABELS = ("model_name", "engine")


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as declared (counters without "_total")
    kind: str  # "gauge" | "counter" | "histogram"
    help: str
    buckets: tuple[float, ...] | str | None = None  # "1-2-5": 1, 2, 5, 10, ... up to max_model_len
    extra_labels: tuple[str, ...] = ()
    hidden: bool = False  # deprecated by vLLM: only with --show-hidden-metrics-for-version

    @property
    def exposed_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "vllm:num_requests_running", "gauge", "Number of requests in model execution batches."
    ),
    MetricSpec("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    MetricSpec("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    MetricSpec(
        "vllm:gpu_cache_usage_perc",
        "gauge",
        "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: use vllm:kv_cache_usage_perc.",
        hidden=True,
    ),
    MetricSpec(
        "vllm:prefix_cache_queries",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    MetricSpec(
        "vllm:prefix_cache_hits",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    MetricSpec(
        "vllm:mm_cache_queries",
        "counter",
        "Multi-modal cache queries, in terms of number of queried items.",
    ),
    MetricSpec(
        "vllm:mm_cache_hits",
        "counter",
        "Multi-modal cache hits, in terms of number of cached items.",
    ),
    MetricSpec(
        "vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine."
    ),
    MetricSpec("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
    MetricSpec("vllm:generation_tokens", "counter", "Number of generation tokens processed."),
    MetricSpec(
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
        extra_labels=("finished_reason",),
    ),
    MetricSpec(
        "vllm:request_prompt_tokens", "histogram", "Number of prefill tokens processed.", "1-2-5"
    ),
    MetricSpec(
        "vllm:request_generation_tokens",
        "histogram",
        "Number of generation tokens processed.",
        "1-2-5",
    ),
    MetricSpec(
        "vllm:iteration_tokens_total",
        "histogram",
        "Histogram of number of tokens per engine_step.",
        ITERATION_TOKEN_BUCKETS,
    ),
    MetricSpec(
        "vllm:request_max_num_generation_tokens",
        "histogram",
        "Histogram of maximum number of requested generation tokens.",
        "1-2-5",
    ),
    MetricSpec(
        "vllm:request_params_n", "histogram", "Histogram of the n request parameter.", N_BUCKETS
    ),
    MetricSpec(
        "vllm:request_params_max_tokens",
        "histogram",
        "Histogram of the max_tokens request parameter.",
        "1-2-5",
    ),
    MetricSpec(
        "vllm:time_to_first_token_seconds",
        "histogram",
        "Histogram of time to first token in seconds.",
        TTFT_BUCKETS,
    ),
    MetricSpec(
        "vllm:inter_token_latency_seconds",
        "histogram",
        "Histogram of inter-token latency in seconds.",
        ITL_BUCKETS,
    ),
    MetricSpec(
        "vllm:time_per_output_token_seconds",
        "histogram",
        "Histogram of time per output "
        "token in seconds. DEPRECATED: use vllm:inter_token_latency_seconds.",
        ITL_BUCKETS,
        hidden=True,
    ),
    MetricSpec(
        "vllm:request_time_per_output_token_seconds",
        "histogram",
        "Histogram of time_per_output_token_seconds per request.",
        ITL_BUCKETS,
    ),
    MetricSpec(
        "vllm:e2e_request_latency_seconds",
        "histogram",
        "Histogram of e2e request latency in seconds.",
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "vllm:request_queue_time_seconds",
        "histogram",
        "Histogram of time spent in WAITING phase for request.",
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "vllm:request_inference_time_seconds",
        "histogram",
        "Histogram of time spent in RUNNING phase for request.",
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "vllm:request_prefill_time_seconds",
        "histogram",
        "Histogram of time spent in PREFILL phase for request.",
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "vllm:request_decode_time_seconds",
        "histogram",
        "Histogram of time spent in DECODE phase for request.",
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
        extra_labels=(
            "block_size",
            "enable_prefix_caching",
            "gpu_memory_utilization",
            "num_gpu_blocks",
            "kv_cache_size_tokens",
            "kv_cache_memory_bytes",
        ),
    ),
)

# Only with --speculative-config (as vLLM registers them), so not in METRICS' fixed set.
SPEC_DECODE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts."),
    MetricSpec("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens."),
    MetricSpec("vllm:spec_decode_num_accepted_tokens", "counter",
               "Number of accepted tokens."),
    MetricSpec("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
               "Accepted tokens per draft position.", extra_labels=("position",)),
)

EXPORTED_METRICS: tuple[str, ...] = tuple(m.exposed_name for m in METRICS if not m.hidden)
HIDDEN_METRICS: tuple[str, ...] = tuple(m.exposed_name for m in METRICS if m.hidden)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


def _make(spec: MetricSpec, registry: Any, max_model_len: int) -> Any:
    import prometheus_client as prom

    labels = [*LABELS, *spec.extra_labels]
    if spec.kind == "gauge":
        # several API processes: one of them sets the engine's gauges (core_hub.py)
        mode = "mostrecent" if envs.prometheus_multiproc_dir() else "all"
        return prom.Gauge(spec.name, spec.help, labels, registry=registry,
                          multiprocess_mode=mode)
    if spec.kind == "counter":
        return prom.Counter(spec.name, spec.help, labels, registry=registry)
    buckets = build_1_2_5_buckets(max_model_len) if spec.buckets == "1-2-5" else spec.buckets
    return prom.Histogram(spec.name, spec.help, labels, buckets=buckets, registry=registry)


class PrometheusStatLogger:
    """Turns ``EngineStats`` into the ``vllm:*`` series of one registry: one series per engine
    (data-parallel rank, the ``engine`` label), as vLLM labels them; a dashboard sums them."""

    def __init__(
        self, registry: Any, model_name: str, max_model_len: int, show_hidden: bool = False,
        speculative: bool = False, engine_indexes: tuple[int, ...] = (0,),
        mm_cache: MultiModalCacheSource | None = None,
    ) -> None:
        self.registry = registry
        self.model_name = model_name
        self.mm_cache = mm_cache  # None: no processed-image cache (text model, or 0 GB)
        self._last_mm = MultiModalCacheStats()
        self._families: dict[str, Any] = {}
        for spec in METRICS + (SPEC_DECODE_METRICS if speculative else ()):
            if spec.hidden and not show_hidden:
                continue
            self._families[spec.name] = _make(spec, registry, max_model_len)
        self._engines = {i: _EngineSeries(self._families, model_name, i) for i in engine_indexes}

    def log_cache_config(
        self,
        block_size: int,
        enable_prefix_caching: bool,
        gpu_memory_utilization: float,
        num_blocks: int,
        memory_bytes: int,
    ) -> None:
        """The info gauge (value 1) whose labels describe the KV cache (of each engine)."""
        for engine in self._engines.values():
            self._families["vllm:cache_config_info"].labels(
                block_size=str(block_size),
                enable_prefix_caching=str(enable_prefix_caching),
                gpu_memory_utilization=str(gpu_memory_utilization),
                num_gpu_blocks=str(num_blocks),
                kv_cache_size_tokens=str(num_blocks * block_size),
                kv_cache_memory_bytes=str(memory_bytes),
                **engine.labels,
            ).set(1)

    def record(self, stats: EngineStats) -> None:
        engine = self._engines.get(stats.engine_index)
        if engine is None:
            engine = self._engines[stats.engine_index] = _EngineSeries(
                self._families, self.model_name, stats.engine_index)
        engine.record(stats)
        self._record_mm_cache(min(self._engines))

    def _record_mm_cache(self, engine_index: int) -> None:
        """The image cache sits in the API process, one for all engines: its totals are read
        at each step and counted once, under the first engine's label."""
        if self.mm_cache is None:
            return
        mm, last = self.mm_cache(), self._last_mm
        labels = {"model_name": self.model_name, "engine": str(engine_index)}
        for name, value, previous in (("vllm:mm_cache_queries", mm.queries, last.queries),
                                      ("vllm:mm_cache_hits", mm.hits, last.hits)):
            if value > previous:
                self._families[name].labels(**labels).inc(value - previous)
        self._last_mm = mm


class _EngineSeries:
    """One engine's labelled children of every metric family."""

    def __init__(self, families: dict[str, Any], model_name: str, engine_index: int) -> None:
        labels = {"model_name": model_name, "engine": str(engine_index)}
        self.labels = labels
        self._families = families
        self._m: dict[str, Any] = {
            name: family.labels(**labels) for name, family in families.items()
            if name not in ("vllm:request_success", "vllm:cache_config_info",
                            "vllm:spec_decode_num_accepted_tokens_per_pos")
        }
        self._success = {
            reason: families["vllm:request_success"].labels(finished_reason=reason, **labels)
            for reason in FINISH_REASONS
        }
        self._last_queries = self._last_hits = self._last_preemptions = 0

    def record(self, stats: EngineStats) -> None:
        m = self._m
        m["vllm:num_requests_running"].set(stats.num_running)
        m["vllm:num_requests_waiting"].set(stats.num_waiting)
        m["vllm:kv_cache_usage_perc"].set(stats.kv_cache_usage)
        if "vllm:gpu_cache_usage_perc" in m:
            m["vllm:gpu_cache_usage_perc"].set(stats.kv_cache_usage)
        self._record_cumulative(stats)
        it = stats.iteration
        m["vllm:prompt_tokens"].inc(it.num_prompt_tokens)
        m["vllm:generation_tokens"].inc(it.num_generation_tokens)
        if it.num_scheduled_tokens:
            m["vllm:iteration_tokens_total"].observe(it.num_scheduled_tokens)
        for ttft in it.ttfts_s:
            m["vllm:time_to_first_token_seconds"].observe(ttft)
        for itl in it.itls_s:
            m["vllm:inter_token_latency_seconds"].observe(itl)
            if "vllm:time_per_output_token_seconds" in m:
                m["vllm:time_per_output_token_seconds"].observe(itl)
        for finished in it.finished:
            self._record_finished(finished)
        if stats.iteration.spec_decoding is not None and "vllm:spec_decode_num_drafts" in m:
            self._record_spec_decoding(stats.iteration.spec_decoding)

    def _record_spec_decoding(self, spec: SpecDecodingStats) -> None:
        m = self._m
        m["vllm:spec_decode_num_drafts"].inc(spec.num_drafts)
        m["vllm:spec_decode_num_draft_tokens"].inc(spec.num_draft_tokens)
        m["vllm:spec_decode_num_accepted_tokens"].inc(spec.num_accepted_tokens)
        per_pos = self._families["vllm:spec_decode_num_accepted_tokens_per_pos"]
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.labels(position=str(position), **self.labels).inc(count)

    def _record_cumulative(self, stats: EngineStats) -> None:
        """The engine reports these as running totals; counters take the increase. A total that
        went down (a reset) starts a new baseline instead of a negative increment."""
        for name, attr, value in (
            ("vllm:prefix_cache_queries", "_last_queries", stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "_last_hits", stats.prefix_cache_hits),
            ("vllm:num_preemptions", "_last_preemptions", stats.num_preemptions),
        ):
            last = getattr(self, attr)
            if value > last:
                self._m[name].inc(value - last)
            setattr(self, attr, value)

    def _record_finished(self, f: FinishedRequestStats) -> None:
        m = self._m
        self._success.get(f.finish_reason, self._success["abort"]).inc()
        m["vllm:e2e_request_latency_seconds"].observe(f.e2e_latency_s)
        m["vllm:request_queue_time_seconds"].observe(f.queue_time_s)
        m["vllm:request_inference_time_seconds"].observe(f.prefill_time_s + f.decode_time_s)
        m["vllm:request_prefill_time_seconds"].observe(f.prefill_time_s)
        m["vllm:request_decode_time_seconds"].observe(f.decode_time_s)
        m["vllm:request_prompt_tokens"].observe(f.num_prompt_tokens)
        m["vllm:request_generation_tokens"].observe(f.num_generation_tokens)
        m["vllm:request_max_num_generation_tokens"].observe(f.num_generation_tokens)
        m["vllm:request_params_n"].observe(f.n)
        if f.max_tokens is not None:
            m["vllm:request_params_max_tokens"].observe(f.max_tokens)
        if f.num_generation_tokens > 1:
            m["vllm:request_time_per_output_token_seconds"].observe(
                f.decode_time_s / (f.num_generation_tokens - 1)
            )


def make_registry(process_metrics: bool = True) -> CollectorRegistry:
    """A fresh registry, with the process and Python collectors ``/metrics`` usually shows
    (not in multiprocess mode, where ``exposition`` reads every process's files instead)."""
    import prometheus_client as prom

    registry = prom.CollectorRegistry()
    if process_metrics and not envs.prometheus_multiproc_dir():
        prom.ProcessCollector(registry=registry)
        prom.PlatformCollector(registry=registry)
        prom.GCCollector(registry=registry)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """``/metrics``: this registry, or in multiprocess mode (``--api-server-count N``) the
    series of every API process, counters summed, as vLLM serves them."""
    import prometheus_client as prom

    folder = envs.prometheus_multiproc_dir()
    if folder is None:
        return prom.generate_latest(registry)
    from prometheus_client import multiprocess

    merged = prom.CollectorRegistry()
    multiprocess.MultiProcessCollector(merged, path=folder)
    return prom.generate_latest(merged)
