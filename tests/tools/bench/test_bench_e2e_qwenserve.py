"""``bench serve`` against the project's own ``qwenserve serve`` on a tiny random Qwen2 model.

The benchmark's counts must agree with the server's own Prometheus counters: every measured and
warm-up request succeeded once, and the prompt and generated tokens the client counted are the
ones the engine processed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from bench_prom import delta, scrape

from helpers.ports import free_port

SERVED = "tiny-qwen2"
COUNTERS = (
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)




def wait_ready(proc: subprocess.Popen, base_url: str, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"qwenserve serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"qwenserve serve not ready after {timeout_s} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    from helpers.tiny_models import make_tiny_model

    model_dir = make_tiny_model("qwen2", str(tmp_path_factory.mktemp("tiny_qwen2")))
    port = free_port()
    log = tmp_path_factory.mktemp("server_log") / "serve.log"
    cmd = [sys.executable, "-m", "qwenserve.entrypoints.cli", "serve", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--served-model-name", SERVED, "--max-model-len", "256", "--max-num-seqs", "8",
           "--kv-cache-memory-bytes", "64M"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base_url, log)
        yield base_url, model_dir
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_counts_agree_with_server_metrics(tiny_server, run_cli, tmp_path: Path, backend) -> None:  # noqa: ANN001
    base_url, model_dir = tiny_server
    before = scrape(base_url)
    code, out, err = run_cli([
        "bench", "serve", "--base-url", base_url, "--model", SERVED, "--backend", backend,
        "--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", "24",
        "--random-output-len", "8", "--num-prompts", "6", "--warmup-requests", "2",
        "--max-concurrency", "4", "--disable-tqdm", "--save-result", "--save-detailed",
        "--result-filename", str(tmp_path / "r.json"),
    ])  # fmt: skip
    assert code == 0, err
    after = scrape(base_url)
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["completed"], r["failed"], r["output_token_source"]) == (6, 0, "usage")
    assert r["output_lens"] == [8] * 6  # ignore_eos: exactly the asked length
    d = delta(before, after)
    assert d["vllm:request_success_total"] == 6 + 2
    assert d["vllm:generation_tokens_total"] == r["total_output_tokens"] + r["warmup_output_tokens"]
    # prompt counts come from the server's usage (vLLM), so chat template tokens are included
    assert d["vllm:prompt_tokens_total"] == r["total_input_tokens"] + r["warmup_input_tokens"]
    assert r["mean_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0 and "Serving Benchmark Result" in out
