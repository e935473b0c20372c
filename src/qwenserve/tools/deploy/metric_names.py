"""The Prometheus series the dashboard and alerts may query, derived from the server's own
metric table (``qwenserve.metrics.prometheus.METRICS``), so they can never name a metric the
server does not export. Counters carry their ``_total`` suffix as exposed; histograms are
queried through ``_bucket``/``_sum``/``_count``.
"""

from __future__ import annotations

from qwenserve.metrics.prometheus import METRICS

_VISIBLE = tuple(m for m in METRICS if not m.hidden)
GAUGES: tuple[str, ...] = tuple(m.exposed_name for m in _VISIBLE if m.kind == "gauge")
COUNTERS: tuple[str, ...] = tuple(m.exposed_name for m in _VISIBLE if m.kind == "counter")
HISTOGRAMS: tuple[str, ...] = tuple(m.exposed_name for m in _VISIBLE if m.kind == "histogram")
EXPORTED_METRICS: tuple[str, ...] = GAUGES + COUNTERS + HISTOGRAMS
HISTOGRAM_SUFFIXES: tuple[str, ...] = ("_bucket", "_sum", "_count")


def series_names() -> frozenset[str]:
    """Every series name a query may use: gauges, counters and the histograms' three series."""
    histogram_series = {h + s for h in HISTOGRAMS for s in HISTOGRAM_SUFFIXES}
    return frozenset(GAUGES + COUNTERS) | histogram_series
