"""Reading vLLM's Prometheus counters from a server's ``/metrics`` (tests only)."""

from __future__ import annotations

import httpx

COUNTERS = (
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)


def scrape(base_url: str) -> dict[str, float]:
    """Each counter of ``COUNTERS`` summed over all its label sets."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in COUNTERS}
