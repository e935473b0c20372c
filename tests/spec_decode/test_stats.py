"""Speculative-decoding counters: vLLM's Prometheus names and the periodic log line."""

from __future__ import annotations

import logging

from qwenserve.metrics.loggers import LoggingStatLogger
from qwenserve.metrics.prometheus import EXPORTED_METRICS, PrometheusStatLogger, make_registry
from qwenserve.metrics.stats import EngineStats, IterationStats, SpecDecodingStats


def _stats(spec):
    return EngineStats(1, 0, 0.1, 0, 0, 0, IterationStats(spec_decoding=spec))


def test_observe_and_merge():
    s = SpecDecodingStats()
    s.observe(3, 2)
    s.observe(2, 0)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 5, 2)
    assert s.num_accepted_tokens_per_pos == [1, 1, 0]
    t = SpecDecodingStats()
    t.observe(4, 4)
    s.merge(t)
    assert s.num_accepted_tokens_per_pos == [2, 2, 1, 1]


def test_prometheus_counters_only_when_speculating():
    registry = make_registry(process_metrics=False)
    logger = PrometheusStatLogger(registry, "m", 1024, speculative=True)
    spec = SpecDecodingStats()
    spec.observe(3, 2)
    logger.record(_stats(spec))
    logger.record(_stats(spec))
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:spec_decode_num_drafts_total", labels) == 2
    assert registry.get_sample_value("vllm:spec_decode_num_draft_tokens_total", labels) == 6
    assert registry.get_sample_value("vllm:spec_decode_num_accepted_tokens_total", labels) == 4
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert registry.get_sample_value(per_pos, {**labels, "position": "1"}) == 2
    plain = make_registry(process_metrics=False)
    PrometheusStatLogger(plain, "m", 1024).record(_stats(None))
    assert plain.get_sample_value("vllm:spec_decode_num_drafts_total", labels) is None
    assert not any("spec_decode" in n for n in EXPORTED_METRICS)


def test_log_line(caplog):
    logger = LoggingStatLogger(interval_s=0.0)
    spec = SpecDecodingStats()
    spec.observe(4, 3)
    spec.observe(4, 1)
    with caplog.at_level(logging.INFO, logger="qwenserve.engine"):
        logger.record(_stats(spec))
    line = next(r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage())
    assert "Mean acceptance length: 3.00" in line
    assert "Per-position acceptance rate: 1.000, 0.500, 0.500, 0.000" in line
    assert "Avg Draft acceptance rate: 50.0%" in line
