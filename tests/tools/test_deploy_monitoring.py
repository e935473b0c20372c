"""Prometheus config and alerts (promtool), and the Grafana dashboard: every query parses as
PromQL (promtool) and names only metrics the server exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from ops_helpers import require_tool, run_deploy

from qwenserve.tools.deploy.metric_names import EXPORTED_METRICS, HISTOGRAMS, series_names

pytestmark = pytest.mark.usefixtures("clean_env")

_METRIC = re.compile(r"\bvllm:[a-zA-Z0-9_:]+")
_GRAFANA_VARS = {"$__rate_interval": "5m", "$model_name": ".*", "$instance": ".*"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = require_tool("promtool", "prometheus")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)


def dashboard_queries(dashboard: dict) -> list[str]:
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    return queries + [v["query"]["query"] for v in dashboard["templating"]["list"]]


def assert_only_exported_series(expr: str) -> None:
    names = _METRIC.findall(expr)
    assert names, f"no vllm metric in {expr!r}"
    for name in names:
        assert name in series_names(), f"{name} is not exported (query: {expr})"


def test_metric_list_is_consistent():
    assert len(set(EXPORTED_METRICS)) == len(EXPORTED_METRICS)
    assert all(name.startswith("vllm:") for name in EXPORTED_METRICS)
    assert "vllm:iteration_tokens_total_bucket" in series_names()
    assert "vllm:time_to_first_token_seconds" not in series_names()  # only its _bucket/_sum/_count


def served_series() -> tuple[set[str], set[str]]:
    """(series names, label names) of a real ``/metrics`` page: the server's registry and logger
    after one engine step that finished a request, exposed by prometheus_client."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from qwenserve.metrics.prometheus import PrometheusStatLogger, make_registry
    from qwenserve.metrics.stats import EngineStats, FinishedRequestStats, IterationStats

    registry = make_registry()
    logger = PrometheusStatLogger(registry, "qwen3", max_model_len=4096)
    finished = FinishedRequestStats("stop", 1.5, 0.1, 0.2, 1.2, 12, 30, 64)
    iteration = IterationStats(12, 30, 42, [0.2], [0.04] * 29, [finished])
    logger.record(EngineStats(num_running=1, num_waiting=0, kv_cache_usage=0.25,
                              prefix_cache_queries=12, prefix_cache_hits=4, num_preemptions=0,
                              iteration=iteration))  # fmt: skip
    text = generate_latest(registry).decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return {s.name for s in samples}, {k for s in samples for k in s.labels}


def test_the_server_exposes_every_series_the_dashboard_and_alerts_query(tmp_path):
    """Checked against what /metrics really prints, not against the table the names come from."""
    names, labels = served_series()
    files = {**run_deploy(tmp_path / "g", "grafana"), **run_deploy(tmp_path / "p", "prometheus")}
    dashboard = json.loads(files["qwenserve-dashboard.json"].read_text())
    rules = yaml.safe_load(files["qwenserve-alerts.yml"].read_text())["groups"][0]["rules"]
    queries = dashboard_queries(dashboard) + [r["expr"] for r in rules]
    used = {name for expr in queries for name in _METRIC.findall(expr)}
    assert used and used <= names, used - names
    grouped = {g.strip() for expr in queries for by in re.findall(r"by \(([^)]*)\)", expr)
               for g in by.split(",")}  # fmt: skip
    assert grouped - {"instance"} <= labels | {"le"}  # instance is added by the scrape
    assert {"model_name", "engine", "finished_reason"} <= labels


def test_prometheus_config_and_rules_pass_promtool(tmp_path):
    files = run_deploy(tmp_path, "prometheus", "--backends", "10.0.0.1:8000,10.0.0.2:8000",
                       "--scrape-interval", "10s")  # fmt: skip
    result = promtool("check", "config", str(files["prometheus.yml"]))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout
    config = yaml.safe_load(files["prometheus.yml"].read_text())
    job = config["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and config["global"]["scrape_interval"] == "10s"
    assert job["static_configs"][0]["targets"] == ["10.0.0.1:8000", "10.0.0.2:8000"]


def test_promtool_rejects_a_broken_rule(tmp_path):
    """The check above can fail: a typo in PromQL is an error."""
    files = run_deploy(tmp_path, "prometheus")
    alerts = files["qwenserve-alerts.yml"]
    alerts.write_text(alerts.read_text().replace("> 0.95", "> > 0.95"))
    assert promtool("check", "rules", str(alerts)).returncode != 0


def test_alerts_use_only_exported_metrics(tmp_path):
    files = run_deploy(tmp_path, "prometheus")
    rules = yaml.safe_load(files["qwenserve-alerts.yml"].read_text())["groups"][0]["rules"]
    for rule in rules:
        if not rule["expr"].startswith("up{"):
            assert_only_exported_series(rule["expr"])


@pytest.fixture
def dashboard(tmp_path) -> dict:
    files = run_deploy(tmp_path, "grafana")
    return json.loads(files["qwenserve-dashboard.json"].read_text())


def test_dashboard_queries_name_only_exported_metrics(dashboard):
    for expr in dashboard_queries(dashboard):
        assert_only_exported_series(expr)


def test_dashboard_covers_what_operators_watch(dashboard):
    used = {name for expr in dashboard_queries(dashboard) for name in _METRIC.findall(expr)}
    stripped = {n: re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    bases = {base if base in HISTOGRAMS else n for n, base in stripped.items()}
    watched = {"vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
               "vllm:generation_tokens_total", "vllm:request_success_total",
               "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
               "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds",
               "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds"}
    assert watched <= bases <= set(EXPORTED_METRICS)
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for word in (
        "throughput",
        "first token",
        "Inter-token",
        "running",
        "KV cache",
        "Prefix cache hit",
    ):
        assert word in titles
    ttft = next(p for p in dashboard["panels"] if p["title"] == "Time to first token")
    assert [t["legendFormat"] for t in ttft["targets"]] == ["p50", "p90", "p99"]


def test_dashboard_queries_are_valid_promql(dashboard, tmp_path):
    """promtool parses every panel query (as a recording rule) with Grafana's variables filled."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for variable, value in _GRAFANA_VARS.items():
        exprs = [e.replace(variable, value) for e in exprs]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": e} for i, e in enumerate(exprs)]}]}  # fmt: skip
    path = Path(tmp_path) / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in result.stdout, (
        result.stderr
    )


def test_dashboard_is_importable_json(dashboard):
    assert dashboard["__inputs"][0]["name"] == "DS_PROMETHEUS"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and {"model_name", "instance"} == {
        v["name"] for v in dashboard["templating"]["list"]
    }


def test_metric_names_come_from_the_server_table():
    from qwenserve.metrics.prometheus import EXPORTED_METRICS as SERVER_METRICS

    assert set(EXPORTED_METRICS) == set(SERVER_METRICS)
    assert "vllm:time_to_first_token_seconds" in HISTOGRAMS
