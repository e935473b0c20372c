"""A Grafana dashboard on the ``vllm:*`` metrics: throughput, latency percentiles, queue, cache.

Built as data and dumped as JSON (importable through Dashboards > Import; it asks for the
Prometheus data source). Every query names only metrics from ``metric_names`` (a test checks it),
filtered by the ``model_name`` and ``instance`` variables.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

_DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
_FILTER = 'model_name=~"$model_name", instance=~"$instance"'
_RATE = "$__rate_interval"
_QUANTILES = ((0.5, "p50"), (0.9, "p90"), (0.99, "p99"))


def _quantiles(histogram: str, by: str = "le") -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by ({by}) (rate({histogram}_bucket{{{_FILTER}}}[{_RATE}])))",
            label,
        )
        for q, label in _QUANTILES
    ]


def _rate(counter: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({counter}{{{_FILTER}}}[{_RATE}]))"


def _panel(
    panel_id: int, title: str, targets: Sequence[tuple[str, str]], unit: str, grid: tuple[int, int]
) -> dict[str, object]:
    x, y = grid
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "datasource": _DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "expr": expr,
                "legendFormat": legend,
                "datasource": _DATASOURCE,
            }
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def panel_specs() -> list[tuple[str, list[tuple[str, str]], str]]:
    """(title, [(PromQL, legend)], unit) for each panel, in reading order."""
    hits, queries = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
    return [
        ("Token throughput", [(_rate("vllm:prompt_tokens_total"), "prompt tokens/s"),
                              (_rate("vllm:generation_tokens_total"), "generated tokens/s")], "short"),
        ("Requests running / waiting",
         [(f"sum by (instance) (vllm:num_requests_running{{{_FILTER}}})", "running {{instance}}"),
          (f"sum by (instance) (vllm:num_requests_waiting{{{_FILTER}}})", "waiting {{instance}}")],
         "short"),
        ("Time to first token", _quantiles("vllm:time_to_first_token_seconds"), "s"),
        ("Inter-token latency", _quantiles("vllm:inter_token_latency_seconds"), "s"),
        ("End-to-end request latency", _quantiles("vllm:e2e_request_latency_seconds"), "s"),
        ("Queue time", _quantiles("vllm:request_queue_time_seconds"), "s"),
        ("KV cache usage",
         [(f"max by (instance) (vllm:kv_cache_usage_perc{{{_FILTER}}})", "{{instance}}")],
         "percentunit"),
        ("Prefix cache hit rate",
         [(f"{_rate(hits, 'instance')} / {_rate(queries, 'instance')}", "{{instance}}")],
         "percentunit"),
        ("Finished requests by reason",
         [(_rate("vllm:request_success_total", "finished_reason"), "{{finished_reason}}")], "reqps"),
        ("Preemptions", [(_rate("vllm:num_preemptions_total", "instance"), "{{instance}}")], "short"),
        ("Prompt / generation length (p50, p90)",
         [(e, f"prompt {n}") for e, n in _quantiles("vllm:request_prompt_tokens")[:2]]
         + [(e, f"generation {n}") for e, n in _quantiles("vllm:request_generation_tokens")[:2]],
         "short"),
        ("Tokens per engine step", _quantiles("vllm:iteration_tokens_total"), "short"),
    ]  # fmt: skip


def _variable(name: str, query: str) -> dict[str, object]:
    return {
        "name": name,
        "type": "query",
        "datasource": _DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
    }


def dashboard(title: str) -> dict[str, object]:
    panels = [
        _panel(i + 1, name, targets, unit, grid=(12 * (i % 2), 8 * (i // 2)))
        for i, (name, targets, unit) in enumerate(panel_specs())
    ]
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "title": f"{title} (vLLM metrics)",
        "uid": f"{title}-vllm"[:40],
        "tags": ["qwenserve", "vllm", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [
            _variable("model_name", "label_values(vllm:num_requests_running, model_name)"),
            _variable("instance", 'label_values(vllm:num_requests_running{model_name=~"$model_name"}, instance)'),
        ]},
        "panels": panels,
    }  # fmt: skip


def dashboard_json(title: str) -> str:
    return json.dumps(dashboard(title), indent=2) + "\n"
