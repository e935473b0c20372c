"""Metric arithmetic on synthetic timestamps, against values computed by hand."""

from __future__ import annotations

import pytest

from qwenserve.tools.bench.metrics import (
    RequestResult,
    calculate_metrics,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    peak_concurrency,
    peak_output_tokens_per_s,
    queue_stats,
)
from qwenserve.tools.bench.results import count_output_tokens, format_console

approx = pytest.approx


def synthetic() -> tuple[list[RequestResult], list[int]]:
    """Three successes and one failure; output lens as a server's usage would report them.

    R1 4 tokens: TTFT 0.1, gaps .05 .05 .1 -> E2EL 0.3, TPOT (0.3-0.1)/3
    R2 2 tokens: TTFT 0.2, gap .1 -> E2EL 0.3, TPOT 0.1
    R3 failed
    R4 1 token: TTFT 0.3 -> E2EL 0.3, no TPOT sample (0 for goodput)
    """
    results = [
        RequestResult(True, 10, 0.0, 0.1, [0.05, 0.05, 0.1], 0.3, 4),
        RequestResult(True, 20, 0.5, 0.2, [0.1], 0.3, 2),
        RequestResult(False, 30, 0.6, error="HTTP 500: boom"),
        RequestResult(True, 40, 1.2, 0.3, [], 0.3, 1),
    ]
    return results, [4, 2, 0, 1]


def test_counts_and_throughputs() -> None:
    results, lens = synthetic()
    m = calculate_metrics(results, lens, duration_s=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 70, 7)
    assert m.request_throughput == approx(1.5)
    assert m.output_throughput == approx(3.5)
    assert m.total_token_throughput == approx(38.5)


def test_latency_statistics() -> None:
    results, lens = synthetic()
    s = calculate_metrics(results, lens, 2.0, [50, 99]).stats
    assert (s["ttft"].mean_ms, s["ttft"].median_ms) == (approx(200), approx(200))
    assert s["ttft"].std_ms == approx(81.649658)  # population std of 100, 200, 300 ms
    assert dict(s["ttft"].percentiles_ms) == {50: approx(200), 99: approx(298)}  # 200 + .98*100
    assert s["tpot"].mean_ms == approx((200 / 3 + 100) / 2)
    assert s["tpot"].std_ms == approx(50 / 3)
    assert dict(s["tpot"].percentiles_ms)[99] == approx(200 / 3 + 0.99 * 100 / 3)
    assert (s["itl"].mean_ms, s["itl"].median_ms, s["itl"].std_ms) == (
        approx(75),
        approx(75),
        approx(25),
    )
    assert dict(s["itl"].percentiles_ms)[99] == approx(100)
    assert (s["e2el"].mean_ms, s["e2el"].std_ms) == (approx(300), approx(0, abs=1e-9))


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 250}, 2),  # R4's 300 ms TTFT misses
        ({"tpot": 80}, 2),  # R2's 100 ms misses; R4 counts as TPOT 0
        ({"ttft": 250, "tpot": 80}, 1),  # every SLO must hold
        ({"e2el": 300}, 3),  # the bound is inclusive
        ({"e2el": 299}, 0),
    ],
)
def test_goodput(slos: dict[str, float], good: int) -> None:
    results, lens = synthetic()
    m = calculate_metrics(results, lens, 2.0, [99], goodput_ms=slos)
    assert m.request_goodput == approx(good / 2.0)


def test_peaks() -> None:
    results, _ = synthetic()
    ok = [r for r in results if r.success]
    # chunk times 0.1 .15 .2 .3 | .7 .8 | 1.5 -> six chunks in second 0, one in second 1
    assert peak_output_tokens_per_s(ok) == 6.0
    assert peak_concurrency(ok) == 1
    overlapping = [
        RequestResult(True, start_time=0.0, latency=1.0),
        RequestResult(True, start_time=0.5, latency=1.0),
        RequestResult(True, start_time=1.0, latency=1.0),  # starts as the first one ends
    ]
    assert peak_concurrency(overlapping) == 2


def test_all_failed_gives_zeros_not_errors() -> None:
    results = [RequestResult(False, 5, error="x"), RequestResult(False, 5, error="y")]
    m = calculate_metrics(results, [0, 0], 1.0, [99])
    assert (m.completed, m.failed, m.output_throughput, m.stats["ttft"].mean_ms) == (0, 2, 0, 0)
    assert m.max_output_tokens_per_s == 0 and m.max_concurrent_requests == 0


class WordTokenizer:
    name = "words"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


def test_output_token_source() -> None:
    with_usage = RequestResult(True, itl=[0.1], output_tokens=7, generated_text="a b")
    without = RequestResult(True, itl=[0.1, 0.1], generated_text="a b c d")
    failed = RequestResult(False, output_tokens=9)
    assert count_output_tokens([with_usage, failed], None) == ([7, 0], "usage")
    assert count_output_tokens([without], WordTokenizer()) == ([4], "tokenizer")
    assert count_output_tokens([with_usage, without], WordTokenizer()) == (
        [7, 4],
        "tokenizer+usage",
    )
    assert count_output_tokens([without], None) == ([3], "chunks")  # 1 + two gaps
    assert count_output_tokens([failed], None) == ([0], "none")


def test_console_block_matches_vllm_layout() -> None:
    results, lens = synthetic()
    m = calculate_metrics(results, lens, 2.0, [99])
    text = format_console(m, 2.0, (4.0, 8), ["ttft", "tpot", "itl"], show_goodput=False)
    lines = text.splitlines()
    assert lines[0] == "{:=^50}".format(" Serving Benchmark Result ")
    assert "Successful requests:                     3         " in lines
    assert "Maximum request concurrency:             8         " in lines
    assert "Request rate configured (RPS):           4.00      " in lines
    assert "Peak concurrent requests:                1.00      " in lines
    assert "{:-^50}".format("Time per Output Token (excl. 1st token)") in lines
    assert "P99 TTFT (ms):                           298.00    " in lines
    assert "Total token throughput (tok/s):          38.50     " in lines
    assert "E2EL" not in text  # not selected
    assert lines[-1] == "=" * 50


def test_flag_parsers() -> None:
    assert parse_goodput(["ttft:500", "e2el:1e4"]) == {"ttft": 500.0, "e2el": 10000.0}
    assert parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    assert parse_metric_names("ttft,e2el") == ["ttft", "e2el"]
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert parse_percentiles("0,100") == [0.0, 100.0]  # min and max, as numpy (and vLLM) allow
    for bad_p in ("", "-1", "101", "x"):
        with pytest.raises(ValueError):
            parse_percentiles(bad_p)
    with pytest.raises(ValueError):
        parse_metric_names("ttft,latency")


def test_client_queue_figures() -> None:
    """vLLM's queueing figures over successful requests only.

    waits 0, 0.2, 0.4 s (the failure's 9 s is ignored); E2EL + wait = 0.3, 0.5, 0.7 s
    """
    results, _ = synthetic()
    for result, wait in zip(results, (0.0, 0.2, 9.0, 0.4), strict=True):
        result.client_queue_time = wait
    s = queue_stats(results, [50, 99], finite_rate=True)
    q, e = s["client_queue_time"], s["e2el_including_client_queue"]
    assert (q.mean_ms, q.median_ms, q.std_ms) == (approx(200), approx(200), approx(163.299316))
    assert dict(q.percentiles_ms)[99] == approx(396)  # 200 + .98 * 200
    assert (e.mean_ms, e.median_ms) == (approx(500), approx(500))
    assert set(queue_stats(results, [99], finite_rate=False)) == {"client_queue_time"}
    assert parse_metric_names("e2el,client_queue_time,e2el_including_client_queue") == [
        "e2el", "client_queue_time", "e2el_including_client_queue"
    ]  # fmt: skip
