"""``--sweep``: one measured run per load point, then the knee of the throughput-latency curve.

Knee rule (documented in docs/bench.md, parameters are flags):

1. A point is *latency-healthy* when its median TTFT and median TPOT are at most
   ``--knee-latency-factor`` (default 3) times those of the lowest load point (a zero baseline
   disables that check). Points that completed no request are ignored.
2. The knee is the highest load among healthy points whose output token throughput reaches
   ``--knee-throughput-frac`` (default 0.9) of the best throughput of the whole sweep: the most
   load the server takes while still near its best throughput and before queueing blows up latency.
3. If no healthy point is near the best throughput (latency degrades before throughput saturates),
   the knee is the healthy point with the highest throughput, and the reason says so.

Between points the server's prefix cache is reset through vLLM's ``POST /reset_prefix_cache`` so a
point cannot profit from the prompts of the one before. If the server lacks that endpoint, each
point uses fresh prompts (``--seed`` + point index) instead, and the report says which was done.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import httpx

from qwenserve.tools.bench.datasets import SampleRequest, build_workload
from qwenserve.tools.bench.errors import BenchError
from qwenserve.tools.bench.results import DETAILED_KEYS, saved_form, write_json
from qwenserve.tools.bench.runner import LoadSpec
from qwenserve.tools.bench.serve import Session, measure, output_path, write_text

KINDS = {"request-rate": "request_rate", "rate": "request_rate", "qps": "request_rate",
         "max-concurrency": "max_concurrency", "concurrency": "max_concurrency"}  # fmt: skip
# A sweep point's summary drops every per-request list, the detailed ones and the rest.
PER_REQUEST_KEYS = (*DETAILED_KEYS, "latencies", "queue_times")


@dataclass(frozen=True)
class SweepSpec:
    """The swept quantity (``request_rate`` or ``max_concurrency``) and its values, ascending."""

    kind: str
    values: tuple[float, ...]

    def load(self, base: LoadSpec, value: float) -> LoadSpec:
        if self.kind == "request_rate":
            return replace(base, request_rate=value)
        return replace(base, max_concurrency=int(value))


def parse_sweep(text: str) -> SweepSpec:
    """``request-rate=1,2,4,inf`` or ``max-concurrency=1,4,16`` (``:`` works as well as ``=``)."""
    sep = "=" if "=" in text else ":"
    name, found, raw = text.partition(sep)
    kind = KINDS.get(name.strip().lower().replace("_", "-"))
    if not found or kind is None:
        raise BenchError(
            f"--sweep expects request-rate=V1,V2,... or max-concurrency=V1,V2,..., got {text!r}"
        )
    try:
        values = sorted({float(v) for v in raw.split(",") if v.strip()})
    except ValueError:
        raise BenchError(
            f"--sweep values must be numbers (or inf for rates), got {raw!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise BenchError(f"--sweep needs one or more values > 0, got {raw!r}")
    if kind == "max_concurrency" and any(math.isinf(v) or v != int(v) for v in values):
        raise BenchError(f"--sweep max-concurrency values must be whole numbers, got {raw!r}")
    return SweepSpec(kind=kind, values=tuple(values))


def check_knee_flags(throughput_frac: float, latency_factor: float) -> None:
    if not 0 < throughput_frac <= 1:
        raise BenchError(f"--knee-throughput-frac must be in (0, 1], got {throughput_frac}")
    if latency_factor < 1:
        raise BenchError(f"--knee-latency-factor must be >= 1, got {latency_factor}")


def format_value(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:g}"


def find_knee(
    points: list[dict[str, Any]], throughput_frac: float = 0.9, latency_factor: float = 3.0
) -> tuple[int | None, str]:
    """Index of the knee in ``points`` (ascending load) and the reason, per the module's rule."""
    usable = [i for i, p in enumerate(points) if p["completed"] > 0]
    if not usable:
        return None, "no load point completed a request"
    base = points[usable[0]]

    def healthy(p: dict[str, Any]) -> bool:
        return all(
            base[key] <= 0 or p[key] <= latency_factor * base[key]
            for key in ("median_ttft_ms", "median_tpot_ms")
        )

    best = max(points[i]["output_throughput"] for i in usable)
    ok = [i for i in usable if healthy(points[i])]
    near_best = [i for i in ok if points[i]["output_throughput"] >= throughput_frac * best]
    rule = (f"median TTFT and TPOT within {latency_factor:g}x of the lowest load's, output "
            f"throughput within {throughput_frac:.0%} of the best ({best:.2f} tok/s)")  # fmt: skip
    if near_best:
        return near_best[-1], f"highest load with {rule}"
    knee = max(ok, key=lambda i: points[i]["output_throughput"])
    return knee, f"latency-bound: no load meets {rule}; highest-throughput point within latency"


def reset_prefix_cache(base_url: str, headers: dict[str, str]) -> bool:
    """Ask the server to drop its prefix cache (vLLM's dev-mode endpoint); False if it cannot."""
    try:
        response = httpx.post(f"{base_url}/reset_prefix_cache", headers=headers, timeout=30.0)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def point_prompts(session: Session, index: int, reset: bool) -> list[SampleRequest]:
    """The prompts of sweep point ``index``: the same as point 0 after a cache reset, else fresh."""
    spec = session.config.dataset
    if index == 0 or reset:
        measured = session.measured
    else:
        fresh = replace(spec, seed=spec.seed + index)
        measured, _ = build_workload(fresh, session.tokenizer, 0, session.sharegpt_entries)
    return [replace(s, request_id=f"{s.request_id}-p{index}") for s in measured]


def summarize_point(result: dict[str, Any], kind: str, value: float) -> dict[str, Any]:
    """A point's result without the per-request lists, tagged with its load."""
    summary = {k: v for k, v in result.items() if k not in PER_REQUEST_KEYS}
    summary["sweep_kind"], summary["sweep_value"] = kind, value
    return summary


def run_points(
    args: argparse.Namespace, session: Session, sweep: SweepSpec, stem: str
) -> list[dict[str, Any]]:
    """Run every load point in ascending order; save each point's JSON when asked."""
    points: list[dict[str, Any]] = []
    for index, value in enumerate(sweep.values):
        reset = index > 0 and reset_prefix_cache(session.config.base_url, session.config.headers)
        load = sweep.load(session.config.load, value)
        print(f"\n=== Sweep point {index + 1}/{len(sweep.values)}: {load.label()} ===")
        result = measure(session, load, point_prompts(session, index, reset))
        result["sweep_prefix_cache"] = _cache_note(session, index, reset)
        if args.save_result:
            name = f"{stem}-{sweep.kind}{format_value(value)}.json"
            write_json(output_path(args, name), saved_form(result, args.save_detailed))
        points.append(summarize_point(result, sweep.kind, value))
    return points


def _cache_note(session: Session, index: int, reset: bool) -> str:
    if index == 0:
        return "first point"
    if reset:
        return "reset before this point"
    return f"not resettable: fresh prompts with seed {session.config.dataset.seed + index}"


def _stem(args: argparse.Namespace, session: Session, sweep: SweepSpec) -> str:
    if args.result_filename:
        return os.path.splitext(args.result_filename)[0]
    model = session.model_id.rstrip("/").split("/")[-1]
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{session.label or args.backend}-sweep-{sweep.kind}-{model}-{stamp}"


def run_sweep(args: argparse.Namespace, session: Session, sweep: SweepSpec) -> int:
    """The sweep, its knee, and the summary JSON, PNG and Markdown that were asked for."""
    from qwenserve.tools.bench.report import sweep_report, sweep_table

    stem = _stem(args, session, sweep)
    points = run_points(args, session, sweep, stem)
    knee, reason = find_knee(points, args.knee_throughput_frac, args.knee_latency_factor)
    percentiles = session.config.percentiles
    print("\n" + sweep_table(points, knee, percentiles) + "\n")
    print(f"Knee: {_knee_text(points, knee)} ({reason})")
    base = output_path(args, stem)
    summary = {"sweep_kind": sweep.kind, "knee_index": knee, "knee_reason": reason,
               "points": points}  # fmt: skip
    if args.save_result:
        write_json(f"{base}.json", summary)
        print(f"Sweep summary saved to {base}.json")
    plot_path = None
    if args.plot is not None:
        from qwenserve.tools.bench.plots import plot_sweep

        plot_path = args.plot or f"{base}.png"
        plot_sweep(points, knee, percentiles, plot_path)
        print(f"Plot saved to {plot_path}")
    if args.report is not None:
        path = args.report or f"{base}.md"
        write_text(path, sweep_report(summary, percentiles, plot_path, path))
        print(f"Report saved to {path}")
    return 0


def _knee_text(points: list[dict[str, Any]], knee: int | None) -> str:
    if knee is None:
        return "none"
    p = points[knee]
    return f"{p['sweep_kind']} = {format_value(p['sweep_value'])}"
