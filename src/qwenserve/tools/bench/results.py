"""Turning a run into numbers people read: output-token counts, vLLM's console block, result JSON.

The console block and the JSON keys are vLLM's, byte for byte where vLLM prints them, so scripts
that scrape ``vllm bench serve`` output or load its JSON into a notebook work unchanged. Our extra
keys (``output_token_source``, ``warmup_*``, ``first_error``) are additions, never renames.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from qwenserve.tools.bench.metrics import (
    METRIC_NAMES,
    QUEUE_METRIC_NAMES,
    BenchmarkMetrics,
    RequestResult,
    percentile_key,
)
from qwenserve.tools.bench.tokenizer import TokenizerLike

METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
    "e2el_including_client_queue": ("E2EL incl. Client Queue",
                                    "Queue-inclusive End-to-end Latency"),
}  # fmt: skip


def count_output_tokens(
    results: list[RequestResult], tokenizer: TokenizerLike | None
) -> tuple[list[int], str]:
    """Each request's output tokens, and where the counts came from.

    vLLM's rule: the server's ``usage.completion_tokens`` when it sent one, else the tokenizer on
    the generated text. Without any tokenizer vLLM would count 1; we count streamed chunks instead,
    which is exact for servers that stream one token per chunk, and say so in the source.
    """
    lens: list[int] = []
    sources: Counter[str] = Counter()
    for result in results:
        if not result.success:
            lens.append(0)
            continue
        if result.output_tokens:
            lens.append(result.output_tokens)
            sources["usage"] += 1
        elif tokenizer is not None:
            lens.append(len(tokenizer.encode(result.generated_text, add_special_tokens=False)))
            sources["tokenizer"] += 1
        else:
            lens.append(1 + len(result.itl))
            sources["chunks"] += 1
    return lens, "+".join(sorted(sources)) or "none"


@dataclass(frozen=True)
class RunInfo:
    """Settings recorded next to the figures (vLLM's leading result keys plus ours)."""

    backend: str
    label: str | None
    model_id: str
    tokenizer_id: str | None
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    dataset_name: str
    seed: int
    goodput_ms: dict[str, float]


def build_result(
    info: RunInfo,
    metrics: BenchmarkMetrics,
    results: list[RequestResult],
    output_lens: list[int],
    duration_s: float,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The result JSON, with vLLM's field names; ``extra`` adds our own keys."""
    rate = "inf" if math.isinf(info.request_rate) else info.request_rate
    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": info.backend,
        "backend": info.backend,
        "label": info.label,
        "model_id": info.model_id,
        "tokenizer_id": info.tokenizer_id,
        "num_prompts": info.num_prompts,
        "request_rate": rate,
        "burstiness": info.burstiness,
        "max_concurrency": info.max_concurrency,
        "dataset_name": info.dataset_name,
        "seed": info.seed,
    }
    out["duration"] = duration_s
    out.update(_figures(metrics))
    if not info.goodput_ms:
        out["request_goodput"] = None  # vLLM writes null when no SLO was given
    out.update(_per_request(results, output_lens))
    out["rtfx"] = 0.0  # vLLM's speech-to-text figure; always 0 for text generation
    for name in METRIC_NAMES + QUEUE_METRIC_NAMES:
        if name in metrics.stats:  # the queueing figures exist only under --max-concurrency
            out.update(_metric_keys(name, metrics))
    out.update(extra)
    return out


def _figures(m: BenchmarkMetrics) -> dict[str, Any]:
    return {
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }


def _per_request(results: list[RequestResult], output_lens: list[int]) -> dict[str, Any]:
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": output_lens,
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "queue_times": [r.client_queue_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }


def _metric_keys(name: str, m: BenchmarkMetrics) -> dict[str, float]:
    s = m.stats[name]
    keys = {
        f"mean_{name}_ms": s.mean_ms,
        f"median_{name}_ms": s.median_ms,
        f"std_{name}_ms": s.std_ms,
    }
    for p, value in s.percentiles_ms:
        keys[f"p{percentile_key(p)}_{name}_ms"] = value
    return keys


def _line(label: str, value: Any, fmt: str = "") -> str:
    return f"{label:<40} {value:<10{fmt}}"


def format_console(
    m: BenchmarkMetrics,
    duration_s: float,
    load: tuple[float, int | None],
    selected_metrics: list[str],
    show_goodput: bool,
) -> str:
    """vLLM's "Serving Benchmark Result" block (``load`` is (request rate, max concurrency))."""
    rate, max_concurrency = load
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines += [_line("Successful requests:", m.completed), _line("Failed requests:", m.failed)]
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if not math.isinf(rate):
        lines.append(_line("Request rate configured (RPS):", rate, ".2f"))
    lines += [
        _line("Benchmark duration (s):", duration_s, ".2f"),
        _line("Total input tokens:", m.total_input),
        _line("Total generated tokens:", m.total_output),
        _line("Request throughput (req/s):", m.request_throughput, ".2f"),
    ]
    if show_goodput:
        lines.append(_line("Request goodput (req/s):", m.request_goodput, ".2f"))
    lines += [
        _line("Output token throughput (tok/s):", m.output_throughput, ".2f"),
        _line("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f"),
        _line("Peak concurrent requests:", float(m.max_concurrent_requests), ".2f"),
        _line("Total token throughput (tok/s):", m.total_token_throughput, ".2f"),
    ]
    for name in METRIC_NAMES + QUEUE_METRIC_NAMES:
        if name in selected_metrics and name in m.stats:
            lines += _metric_lines(name, m)
    lines.append("=" * 50)
    return "\n".join(lines)


def _metric_lines(name: str, m: BenchmarkMetrics) -> list[str]:
    short, header = METRIC_HEADERS[name]
    s = m.stats[name]
    lines = ["{s:{c}^{n}}".format(s=header, n=50, c="-")]
    lines.append(_line(f"Mean {short} (ms):", s.mean_ms, ".2f"))
    lines.append(_line(f"Median {short} (ms):", s.median_ms, ".2f"))
    for p, value in s.percentiles_ms:
        lines.append(_line(f"P{percentile_key(p)} {short} (ms):", value, ".2f"))
    return lines


def result_filename(
    label: str | None, backend: str, load: tuple[float, int | None], model_id: str, stamp: str
) -> str:
    """vLLM's default name: ``{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json``."""
    rate, max_concurrency = load
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    base_model = model_id.rstrip("/").split("/")[-1]
    return f"{label or backend}-{float(rate)}qps{concurrency}-{base_model}-{stamp}.json"


# What vLLM leaves out of the saved JSON unless ``--save-detailed`` is given.
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts",
                 "errors")  # fmt: skip


def saved_form(result: dict[str, Any], detailed: bool) -> dict[str, Any]:
    """The result as ``--save-result`` writes it: without the per-request lists of
    ``DETAILED_KEYS`` unless ``--save-detailed`` (vLLM's behaviour)."""
    if detailed:
        return result
    return {k: v for k, v in result.items() if k not in DETAILED_KEYS}


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path``, creating its folder; JSON has no inf, so inf becomes "inf"."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_finite(data), f, indent=2)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
