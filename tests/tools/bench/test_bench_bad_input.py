"""Bad input: a one-line error and a non-zero exit, before any load reaches the server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

RANDOM = ["--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "2",
          "--num-prompts", "2", "--disable-tqdm"]  # fmt: skip


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_one_line_error(result: tuple[int, str, str], *needles: str) -> str:
    code, _, err = result
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


def serve(base_url: str, *extra: str) -> list[str]:
    return ["bench", "serve", "--base-url", base_url, *extra]


def test_unreachable_server(run_cli) -> None:  # noqa: ANN001
    url = f"http://127.0.0.1:{closed_port()}"
    assert_one_line_error(run_cli(serve(url, *RANDOM)), "cannot reach the server", url)


def test_wrong_model_lists_served_names(make_fake_server, run_cli) -> None:  # noqa: ANN001
    server = make_fake_server(models=("qwen-a", "qwen-b"))
    line = assert_one_line_error(
        run_cli(serve(server.base_url, "--model", "Qwen/Qwen3-8B", *RANDOM))
    )
    assert "'Qwen/Qwen3-8B' is not served" in line and "served: qwen-a, qwen-b" in line
    assert server.state.requests == []


@pytest.mark.parametrize("key", [None, "wrong"])
def test_refused_api_key(make_fake_server, run_cli, monkeypatch, key: str | None) -> None:  # noqa: ANN001
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    server = make_fake_server(api_key="right")
    args = ["--api-key", key] if key else []
    assert_one_line_error(run_cli(serve(server.base_url, *args, *RANDOM)), "API key refused", "401")
    assert server.state.requests == []


def test_missing_dataset_file(fake_server, run_cli, tmp_path: Path) -> None:  # noqa: ANN001
    missing = tmp_path / "nope.json"
    args = ["--dataset-name", "sharegpt", "--dataset-path", str(missing)]
    assert_one_line_error(run_cli(serve(fake_server.base_url, *args)), "dataset file not found")


@pytest.mark.parametrize(
    ("content", "needle"),
    [("[{oops", "is not valid JSON"), ('{"a": 1}', "expected a JSON list"), ("[1, 2]", "no entry")],
)
def test_malformed_dataset_file(
    fake_server, run_cli, tmp_path: Path, content: str, needle: str
) -> None:  # noqa: ANN001
    path = tmp_path / "bad.json"
    path.write_text(content)
    args = ["--dataset-name", "sharegpt", "--dataset-path", str(path)]
    assert_one_line_error(run_cli(serve(fake_server.base_url, *args)), needle)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--dataset-path", "x.json"], "takes no --dataset-path"),
        (["--goodput", "ttft=5"], "--goodput expects KEY:VALUE"),
        (["--goodput", "itl:5"], "is not one of"),
        (["--max-concurrency", "0"], "--max-concurrency must be > 0"),
        (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "needs an endpoint"),
        (["--metric-percentiles", "150"], "[0, 100]"),
        (["--percentile-metrics", "ttft,foo"], "--percentile-metrics accepts"),
        (["--header", "novalue"], "--header expects KEY=VALUE"),
        (["--sweep", "speed=1,2"], "--sweep expects"),
        (["--sweep", "request-rate=1,2", "--knee-latency-factor", "0.5"], "must be >= 1"),
        (["--random-range-ratio", "1.5"], "--random-range-ratio"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--request-rate", "-2"], "--request-rate must be > 0"),
        (["--request-rate", "4", "--burstiness", "0"], "--burstiness must be > 0"),
    ],
)
def test_bad_flags(run_cli, args: list[str], needle: str) -> None:  # noqa: ANN001
    url = f"http://127.0.0.1:{closed_port()}"  # flags are checked before the server is probed
    assert_one_line_error(run_cli(serve(url, *RANDOM, *args)), needle)


def test_no_tokenizer_anywhere(make_fake_server, run_cli) -> None:  # noqa: ANN001
    server = make_fake_server(tokenize=False)
    assert_one_line_error(run_cli(serve(server.base_url, *RANDOM)), "/tokenize", "--tokenizer")
    assert server.state.requests == []


def test_unloadable_tokenizer(fake_server, run_cli, tmp_path: Path) -> None:  # noqa: ANN001
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ["--tokenizer", str(empty), *RANDOM]
    assert_one_line_error(run_cli(serve(fake_server.base_url, *args)), "cannot load a tokenizer")


def test_warmup_that_fails_entirely_stops_before_measuring(fake_server, run_cli) -> None:  # noqa: ANN001
    args = ["--endpoint", "/v2/completions", "--warmup-requests", "2", *RANDOM]
    line = assert_one_line_error(run_cli(serve(fake_server.base_url, *args)))
    assert "all 2 warm-up requests failed: HTTP 404" in line


def test_exit_code_through_the_real_entry_point() -> None:
    """The installed dispatcher turns the error into exit status 1 and one stderr line."""
    url = f"http://127.0.0.1:{closed_port()}"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "qwenserve.entrypoints.cli", "bench", "serve", "--base-url", url,
         *RANDOM],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: cannot reach the server")
