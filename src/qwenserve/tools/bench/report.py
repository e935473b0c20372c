"""Markdown summaries a person can paste into a ticket: settings, figures, knee, failures.

Plain GitHub-flavoured Markdown tables, numbers rounded to what a reader compares (two decimals),
and every setting needed to rerun the measurement, because a figure without its load is useless.
"""

from __future__ import annotations

import math
import os
from typing import Any

from qwenserve.tools.bench.metrics import METRIC_NAMES, QUEUE_METRIC_NAMES, percentile_key
from qwenserve.tools.bench.results import METRIC_HEADERS


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.2f}"
    return str(value)


def _load(value: float) -> str:
    """A load point as given on the command line: 4, 0.5, inf (not 4.00)."""
    return "inf" if math.isinf(float(value)) else f"{float(value):g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _image(plot_path: str | None, report_path: str) -> list[str]:
    if not plot_path:
        return []
    rel = os.path.relpath(plot_path, os.path.dirname(os.path.abspath(report_path)) or ".")
    return ["", f"![benchmark plot]({rel})"]


def _settings(r: dict[str, Any]) -> str:
    conc = r.get("max_concurrency")
    return (
        f"{r.get('date', '')} · qwenserve {r.get('qwenserve_version', '')} · backend "
        f"`{r.get('backend')}` · dataset `{r.get('dataset_name')}`, {r.get('num_prompts')} "
        f"prompts, seed {r.get('seed')} · burstiness {r.get('burstiness')} · max concurrency "
        f"{conc if conc is not None else 'unlimited'} · warm-up {r.get('warmup_requests', 0)} "
        f"requests (excluded) · output tokens counted from `{r.get('output_token_source')}`"
    )


def run_report(
    r: dict[str, Any], percentiles: list[float], plot_path: str | None, report_path: str
) -> str:
    """Report of one measured run, from its result JSON."""
    rows = [
        ["Request rate (req/s)", _num(r["request_rate"])],
        ["Successful / failed requests", f"{r['completed']} / {r['failed']}"],
        ["Benchmark duration (s)", _num(r["duration"])],
        [
            "Total input / generated tokens",
            f"{r['total_input_tokens']} / {r['total_output_tokens']}",
        ],
        ["Request throughput (req/s)", _num(r["request_throughput"])],
        ["Output token throughput (tok/s)", _num(r["output_throughput"])],
        ["Total token throughput (tok/s)", _num(r["total_token_throughput"])],
        ["Peak output token throughput (tok/s)", _num(r["max_output_tokens_per_s"])],
        ["Peak concurrent requests", _num(r["max_concurrent_requests"])],
    ]
    if r.get("request_goodput") is not None:
        rows.append([f"Request goodput (req/s), SLOs {r.get('goodput_slos_ms')}",
                     _num(r["request_goodput"])])  # fmt: skip
    lines = [f"# Serving benchmark: `{r['model_id']}`", "", _settings(r), "", "## Throughput", ""]
    lines += [_table(["Figure", "Value"], rows), "", "## Latency (ms)", ""]
    lines += [_latency_table(r, percentiles)]
    lines += _failures([r])
    lines += _image(plot_path, report_path)
    return "\n".join(lines) + "\n"


def _latency_table(r: dict[str, Any], percentiles: list[float]) -> str:
    keys = [f"p{percentile_key(p)}" for p in percentiles]
    header = ["Metric", "Mean", "Median", "Std", *[k.upper() for k in keys]]
    rows = []
    # the queueing figures are in the JSON only for runs under --max-concurrency
    present = [n for n in QUEUE_METRIC_NAMES if f"mean_{n}_ms" in r]
    for name in (*METRIC_NAMES, *present):
        short = METRIC_HEADERS[name][0]
        values = [r.get(f"{stat}_{name}_ms") for stat in ("mean", "median", "std", *keys)]
        rows.append([short, *(_num(v) for v in values)])
    return _table(header, rows)


def _failures(results: list[dict[str, Any]]) -> list[str]:
    failed = [r for r in results if r.get("failed")]
    if not failed:
        return ["", "No request failed."]
    lines = ["", "## Failures", ""]
    for r in failed:
        where = f"at {r['sweep_kind']} = {_num(r['sweep_value'])}: " if "sweep_value" in r else ""
        lines.append(f"- {where}{r['failed']} failed; first error: `{r.get('first_error')}`")
    return lines


def sweep_table(points: list[dict[str, Any]], knee: int | None, percentiles: list[float]) -> str:
    """One row per load point; the knee row is marked."""
    p_key = f"p{percentile_key(max(percentiles))}"
    kind = points[0]["sweep_kind"].replace("_", " ") if points else "load"
    header = [kind, "ok / failed", "req/s", "output tok/s", "peak tok/s",
              "median TTFT", f"{p_key.upper()} TTFT", "median TPOT", f"{p_key.upper()} TPOT",
              "median ITL", f"{p_key.upper()} ITL", "goodput req/s"]  # fmt: skip
    rows = []
    for i, p in enumerate(points):
        load = _load(p["sweep_value"]) + (" **(knee)**" if i == knee else "")
        rows.append([
            load, f"{p['completed']} / {p['failed']}", _num(p["request_throughput"]),
            _num(p["output_throughput"]), _num(p["max_output_tokens_per_s"]),
            _num(p["median_ttft_ms"]), _num(p.get(f"{p_key}_ttft_ms")),
            _num(p["median_tpot_ms"]), _num(p.get(f"{p_key}_tpot_ms")),
            _num(p["median_itl_ms"]), _num(p.get(f"{p_key}_itl_ms")), _num(p["request_goodput"]),
        ])  # fmt: skip
    return "Latencies in ms.\n\n" + _table(header, rows)


def sweep_report(
    summary: dict[str, Any], percentiles: list[float], plot_path: str | None, report_path: str
) -> str:
    """Report of a sweep: settings, the table, the knee and its rule, failures, the plot."""
    points, knee = summary["points"], summary["knee_index"]
    first = points[0]
    lines = [f"# Serving sweep: `{first['model_id']}`", "", _settings(first), ""]
    lines += ["## Results by load", "", sweep_table(points, knee, percentiles), "", "## Knee", ""]
    if knee is None:
        lines.append(f"No knee: {summary['knee_reason']}.")
    else:
        p = points[knee]
        lines.append(
            f"**{p['sweep_kind'].replace('_', ' ')} = {_load(p['sweep_value'])}**: "
            f"{_num(p['output_throughput'])} output tok/s, median TTFT "
            f"{_num(p['median_ttft_ms'])} ms, median TPOT {_num(p['median_tpot_ms'])} ms."
        )
        lines += ["", f"Rule: {summary['knee_reason']}."]
    lines += ["", f"Prefix cache between points: {_cache_summary(points)}."]
    lines += _failures(points)
    lines += _image(plot_path, report_path)
    return "\n".join(lines) + "\n"


def _cache_summary(points: list[dict[str, Any]]) -> str:
    notes = [p.get("sweep_prefix_cache", "") for p in points[1:]]
    if not notes:
        return "single point"
    if all(n.startswith("reset") for n in notes):
        return (
            "reset through /reset_prefix_cache before every point, all points use the same prompts"
        )
    return (
        "the server has no /reset_prefix_cache, so each point after the first used fresh prompts "
        "(--seed + point index) to avoid prefix-cache hits on earlier points' prompts"
    )
