"""Sweeps: parsing, the knee rule on hand-made curves, and a sweep producing a PNG and a report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from qwenserve.tools.bench.errors import BenchError
from qwenserve.tools.bench.sweep import find_knee, parse_sweep


def curve(tput: list[float], ttft: list[float], tpot: list[float], done: list[int] | None = None):
    done = done or [10] * len(tput)
    return [
        {"output_throughput": a, "median_ttft_ms": b, "median_tpot_ms": c, "completed": d}
        for a, b, c, d in zip(tput, ttft, tpot, done, strict=True)
    ]


def test_parse_sweep() -> None:
    spec = parse_sweep("request-rate=4,1,inf,2")
    assert spec.kind == "request_rate" and spec.values == (1.0, 2.0, 4.0, math.inf)
    assert parse_sweep("max_concurrency:8,2,2").values == (2.0, 8.0)
    for bad in ("foo=1", "request-rate=", "request-rate=0,1", "max-concurrency=1.5",
                "max-concurrency=inf", "request-rate=x", "1,2,4"):  # fmt: skip
        with pytest.raises(BenchError):
            parse_sweep(bad)


def test_knee_is_highest_healthy_load_near_best_throughput() -> None:
    points = curve([100, 190, 350, 380, 385], [50, 52, 60, 120, 900], [20, 21, 25, 40, 80])
    knee, reason = find_knee(points, 0.9, 3.0)
    assert knee == 3  # 380 >= 0.9 * 385 and TTFT 120 <= 3 * 50; the last point's TTFT is 18x
    assert reason.startswith("highest load with")


def test_knee_when_latency_degrades_before_saturation() -> None:
    points = curve([100, 200, 300, 400], [50, 100, 400, 800], [20, 20, 20, 20])
    knee, reason = find_knee(points, 0.9, 3.0)
    assert knee == 1 and reason.startswith("latency-bound")


def test_knee_edge_cases() -> None:
    # a zero TPOT baseline (one-token outputs) does not disqualify anything
    assert find_knee(curve([10, 20, 21], [5, 6, 7], [0, 0, 0]))[0] == 2
    # a point with no completed request is ignored, the baseline is the next one
    assert find_knee(curve([0, 50, 52], [0, 10, 12], [0, 5, 6], [0, 10, 10]))[0] == 2
    assert find_knee(curve([0.0], [0.0], [0.0], [0])) == (None, "no load point completed a request")
    # a looser latency factor admits a higher load; a stricter fraction can leave only a
    # latency-bound choice
    points = curve([100, 180, 200], [10, 25, 40], [5, 5, 5])
    assert find_knee(points, 0.9, 3.0)[0] == 1 and find_knee(points, 0.9, 5.0)[0] == 2
    knee, reason = find_knee(points, 0.95, 3.0)
    assert knee == 1 and reason.startswith("latency-bound")


def test_concurrency_sweep_png_report_and_jsons(fake_server, run_cli, tmp_path: Path) -> None:  # noqa: ANN001
    resets = fake_server.state.resets
    code, out, err = run_cli([
        "bench", "serve", "--base-url", fake_server.base_url, "--model", "fake-model",
        "--disable-tqdm", "--dataset-name", "random", "--random-input-len", "8",
        "--random-output-len", "4", "--num-prompts", "6", "--warmup-requests", "1",
        "--sweep", "max-concurrency=1,2,6", "--plot", "--report", "--save-result", "--save-detailed",
        "--result-dir", str(tmp_path), "--result-filename", "sw.json",
    ])  # fmt: skip
    assert code == 0, err
    assert fake_server.state.resets - resets == 2  # before the 2nd and 3rd points
    assert out.count("{:=^50}".format(" Serving Benchmark Result ")) == 3
    assert (tmp_path / "sw.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((tmp_path / "sw.json").read_text())
    points = summary["points"]
    assert [p["sweep_value"] for p in points] == [1, 2, 6]
    assert [p["max_concurrency"] for p in points] == [1, 2, 6]
    assert all(p["completed"] == 6 and "ttfts" not in p for p in points)
    assert points[0]["output_throughput"] < points[2]["output_throughput"]
    assert summary["knee_index"] is not None
    for value in (1, 2, 6):
        point = json.loads((tmp_path / f"sw-max_concurrency{value}.json").read_text())
        assert point["completed"] == 6 and len(point["ttfts"]) == 6
    report = (tmp_path / "sw.md").read_text()
    assert report.count("**(knee)**") == 1 and "## Knee" in report and "Rule:" in report
    assert "![benchmark plot](sw.png)" in report and "reset through /reset_prefix_cache" in report
    assert "\n| 1 | 6 / 0 |" in report and "\n| 2" in report  # loads as given, not 1.00


def test_rate_sweep_without_cache_reset_uses_fresh_prompts(
    make_fake_server, run_cli, tmp_path
) -> None:  # noqa: ANN001
    server = make_fake_server(reset_cache=False, ttft_s=0.01, itl_s=0.005)
    code, out, err = run_cli([
        "bench", "serve", "--base-url", server.base_url, "--disable-tqdm", "--dataset-name",
        "random", "--random-input-len", "8", "--random-output-len", "3", "--num-prompts", "4",
        "--warmup-requests", "0", "--sweep", "request-rate=50,inf",
        "--report", str(tmp_path / "r.md"),
    ])  # fmt: skip
    assert code == 0, err
    prompts = [body["prompt"] for body in server.state.requests]
    assert len(prompts) == 8 and set(prompts[:4]).isdisjoint(prompts[4:])
    assert "fresh prompts" in (tmp_path / "r.md").read_text()
    assert "Knee: request_rate = " in out
