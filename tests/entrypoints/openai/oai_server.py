"""A ``qwenserve serve`` subprocess for the tests, and the shared constants."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from helpers.ports import free_port

API_KEY = "sk-qwenserve-test"
SERVED = "tiny-qwen"
ALIAS = "tiny-alias"
MAX_MODEL_LEN = 512
ROOT = "/api"  # the hardening server's --root-path
LONG_CONTEXT = 32768  # its max_model_len: prompts up to 32 x this many characters get tokenized
DATA = Path(__file__).parent / "data"
TOOLS_TEMPLATE = str(DATA / "qwen_tools.jinja")


@contextlib.contextmanager
def started_together(starts: dict[str, Callable[[], RemoteServer]],
                     stop_signal: int = signal.SIGTERM) -> Iterator[dict[str, RemoteServer]]:
    """Servers a module needs, started at once so their start-ups overlap (each ``start``
    returns a ``RemoteServer(..., wait=False)``), ready on entry, stopped in reverse on exit."""
    started: dict[str, RemoteServer] = {}
    try:
        for name, start in starts.items():
            started[name] = start()
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in reversed(started.values()):
            server.stop(stop_signal)




class RemoteServer:
    """A ``qwenserve serve`` subprocess on 127.0.0.1 and an ephemeral port."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        *,
        legacy_entry: bool = False,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        ready_timeout_s: float = 180,
        wait: bool = True,
    ) -> None:
        """``wait=False`` returns once the process is spawned: start several servers, then
        ``wait_ready()`` on each, and their start-ups (imports, model loads) overlap."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        entry = (
            ["-m", "qwenserve.entrypoints.openai.api_server"]
            if legacy_entry
            else ["-m", "qwenserve.entrypoints.cli", "serve"]
        )
        cmd = [sys.executable, *entry, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        full_env = {**os.environ, "QWENSERVE_LOGGING_LEVEL": "INFO", **(env or {})}
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
        if wait:
            self.wait_ready(ready_timeout_s)

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        pytest.fail(f"server not ready after {timeout_s} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        kwargs.setdefault("timeout", 60)
        return httpx.post(self.base_url + path, headers=headers, **kwargs)

    def get(self, path: str, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        kwargs.setdefault("timeout", 60)
        return httpx.get(self.base_url + path, headers=headers, **kwargs)

    def client(self):
        import openai

        return openai.OpenAI(
            base_url=self.base_url + "/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            timeout=120,
        )

    def async_client(self):
        import openai

        return openai.AsyncOpenAI(
            base_url=self.base_url + "/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            timeout=120,
        )

    def metrics(self) -> dict[str, float]:
        """``{'name{label="v",...}': value}`` from /metrics (the engine label dropped)."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for family in text_string_to_metric_families(self.get("/metrics").text):
            for s in family.samples:
                labels = ",".join(
                    f"{k}={v}"
                    for k, v in sorted(s.labels.items())
                    if k not in ("engine", "model_name")
                )
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout_s: float = 10) -> dict[str, float]:
        """Metrics once nothing runs and the KV cache is empty (fails after the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (
                m["vllm:kv_cache_usage_perc"] == 0
                and m["vllm:num_requests_running"] == 0
                and m["vllm:num_requests_waiting"] == 0
            )
            if idle or time.monotonic() > deadline:
                assert idle, f"engine not idle: {m['vllm:kv_cache_usage_perc']=}"
                return m
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
