"""PNG figures: load curves for a sweep, a timeline and latency histograms for one run.

Uses matplotlib's object API with the Agg canvas (no pyplot, no display, no global state), so it
works on headless servers and inside test processes. matplotlib is imported only here, only when
``--plot`` is given.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from qwenserve.tools.bench.metrics import percentile_key


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str) -> None:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")


def _label(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:g}"


def plot_sweep(
    points: list[dict[str, Any]], knee: int | None, percentiles: list[float], path: str
) -> None:
    """Throughput and TTFT/TPOT/ITL (median and chosen percentiles) against load; knee marked.

    Load points sit at even positions labelled with their value, which keeps an ``inf`` rate on
    the axis and spreads doubling sequences (1, 2, 4, 8) evenly.
    """
    fig = _figure(12, 8)
    axes = fig.subplots(2, 2)
    x = np.arange(len(points))
    labels = [_label(float(p["sweep_value"])) for p in points]
    kind = points[0]["sweep_kind"].replace("_", " ") if points else "load"
    ax = axes[0][0]
    ax.plot(x, [p["output_throughput"] for p in points], "o-", label="output tok/s")
    ax.plot(x, [p["total_token_throughput"] for p in points], "s--", label="total tok/s")
    ax.set_title("Token throughput")
    ax.set_ylabel("tokens/s")
    if knee is not None:
        ax.plot([knee], [points[knee]["output_throughput"]], "r*", markersize=16, label="knee")
    for ax, name in ((axes[0][1], "ttft"), (axes[1][0], "tpot"), (axes[1][1], "itl")):
        ax.plot(x, [p[f"median_{name}_ms"] for p in points], "o-", label="median")
        for pct in percentiles:
            key = f"p{percentile_key(pct)}_{name}_ms"
            ax.plot(
                x,
                [p.get(key, float("nan")) for p in points],
                ".--",
                label=f"P{percentile_key(pct)}",
            )
        ax.set_title(name.upper())
        ax.set_ylabel("ms")
    for ax in (a for row in axes for a in row):
        ax.set_xticks(x, labels)
        ax.set_xlabel(kind)
        ax.grid(True, alpha=0.3)
        if knee is not None:
            ax.axvline(knee, color="red", linestyle=":", alpha=0.7)
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_run(result: dict[str, Any], path: str) -> None:
    """One run: output chunk rate and requests in flight over time, TTFT and ITL histograms."""
    ok = [i for i, err in enumerate(result["errors"]) if not err]
    starts = [result["start_times"][i] for i in ok]
    ends = [s + result["latencies"][i] for s, i in zip(starts, ok, strict=True)]
    chunk_times = []
    for i in ok:
        t = result["start_times"][i] + result["ttfts"][i]
        chunk_times += list(t + np.cumsum([0.0, *result["itls"][i]]))
    fig = _figure(12, 8)
    axes = fig.subplots(2, 2)
    _plot_chunk_rate(axes[0][0], chunk_times, max(ends, default=1.0))
    times, in_flight = _in_flight(starts, ends)
    axes[0][1].step(times, in_flight, where="post")
    axes[0][1].set_title("Requests in flight")
    for ax in axes[0]:
        ax.set_xlabel("seconds since start")
    axes[1][0].hist([result["ttfts"][i] * 1000 for i in ok] or [0.0], bins=30)
    axes[1][0].set_title("TTFT (ms)")
    axes[1][1].hist([g * 1000 for i in ok for g in result["itls"][i]] or [0.0], bins=30)
    axes[1][1].set_title("ITL (ms)")
    for ax in (a for row in axes for a in row):
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{result['model_id']}: {result['completed']} ok, {result['failed']} failed")
    _save(fig, path)


def _plot_chunk_rate(ax: Any, chunk_times: list[float], end_s: float) -> None:
    """Chunks per second in about 40 bins (at least 50 ms wide), so short runs show a shape."""
    width = max(0.05, end_s / 40)
    edges = np.arange(0.0, end_s + width, width)
    counts, _ = np.histogram(chunk_times, bins=edges)
    ax.bar(edges[:-1], counts / width, width=width, align="edge")
    ax.set_title("Streamed chunks per second (~output tokens/s)")


def _in_flight(starts: list[float], ends: list[float]) -> tuple[list[float], list[int]]:
    """Exact step function of requests in flight, from start/end events."""
    events = sorted([(s, 1) for s in starts] + [(e, -1) for e in ends])
    times, counts, current = [0.0], [0], 0
    for t, delta in events:
        current += delta
        times.append(t)
        counts.append(current)
    return times, counts
