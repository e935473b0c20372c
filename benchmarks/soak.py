"""Soak run: mixed traffic against a real ``qwenserve serve``, with clients that leave mid-way and
a KV cache small enough that the scheduler must preempt.

Requests mix chat and completions, streamed and not, ``n`` of 1 to 3; about one in five clients
disconnects early (a stream closed after a few chunks, or a plain request given up on). At the
end nothing may be left: no 5xx, every finished response complete (``n`` choices, each with a
finish reason; streams end with ``[DONE]``), ``vllm:num_requests_running`` and
``vllm:kv_cache_usage_perc`` back to 0, and the server still answering.

    python benchmarks/soak.py                    # 1000 requests on a tiny random-weight model
    python benchmarks/soak.py --requests 150 --model PATH

``tests/entrypoints/openai/test_soak.py`` runs a smaller version in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port, tiny_qwen2  # noqa: E402

# The server's flags: a 512-token KV cache shared by up to 16 sequences forces preemption.
SERVER_FLAGS = [
    "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "256K",
    "--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--disable-uvicorn-access-log",
    "--disable-log-requests", "--disable-log-stats",
]  # fmt: skip
WORDS = ["The capital", "Hello world", "qwenserve serves", "def add", "How are you", "Paris"]


@dataclass
class SoakReport:
    requests: int = 0
    completed: int = 0
    disconnects: int = 0
    client_errors: int = 0  # 4xx (e.g. 429 when the queue is full): allowed, counted
    server_errors: int = 0  # 5xx or an error event inside a stream: must be 0
    incomplete: int = 0  # a 200 whose choices or stream end were missing: must be 0
    preemptions: int = 0
    running_after: float = -1.0
    kv_usage_after: float = -1.0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return (
            self.server_errors == 0
            and self.incomplete == 0
            and self.running_after == 0
            and self.kv_usage_after == 0
        )


def metrics(base_url: str, headers: dict[str, str]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", headers=headers, timeout=30).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _body(rng: random.Random, model: str) -> tuple[str, dict, int]:
    """(path, body, expected choices) for one random request."""
    n = rng.choice([1, 1, 2, 3])
    common = {"model": model, "n": n, "max_tokens": rng.randint(4, 48), "temperature": 0.8,
              "seed": rng.randint(0, 1 << 30), "stream": rng.random() < 0.5}  # fmt: skip
    text = f"{rng.choice(WORDS)} {rng.randint(0, 999)} {rng.choice(WORDS)}"
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}, n
    prompts = [text, f"{text} {rng.choice(WORDS)}"] if rng.random() < 0.2 else text
    count = n * (len(prompts) if isinstance(prompts, list) else 1)
    return "/v1/completions", {**common, "prompt": prompts}, count


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict, choices: int, leave_after: int | None
) -> str:
    finished: set[int] = set()
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return f"status {r.status_code}: {r.text[:200]}"
        seen = 0
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            seen += 1
            if leave_after is not None and seen >= leave_after:
                return "disconnect"
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                return f"stream error: {chunk['error'].get('message')}"
            for c in chunk.get("choices", []):
                if c.get("finish_reason") is not None:
                    finished.add(c["index"])
    if leave_after is not None:
        return "disconnect" if not done else "ok"
    if not done or len(finished) != choices:
        return f"incomplete: done={done}, finished {len(finished)} of {choices}"
    return "ok"


async def _plain(client: httpx.AsyncClient, path: str, body: dict, choices: int) -> str:
    r = await client.post(path, json=body)
    if r.status_code != 200:
        return f"status {r.status_code}: {r.text[:200]}"
    got = r.json()["choices"]
    if len(got) != choices or any(c.get("finish_reason") is None for c in got):
        return f"incomplete: {len(got)} choices of {choices}"
    return "ok"


async def _one(client: httpx.AsyncClient, rng: random.Random, model: str) -> str:
    path, body, choices = _body(rng, model)
    leave = rng.random() < 0.2
    if body["stream"]:
        return await _stream(client, path, body, choices, rng.randint(1, 6) if leave else None)
    if not leave:
        return await _plain(client, path, body, choices)
    try:
        return await asyncio.wait_for(_plain(client, path, body, choices), rng.uniform(0.01, 0.3))
    except asyncio.TimeoutError:
        return "disconnect"


async def run_soak(
    base_url: str,
    model: str,
    num_requests: int,
    concurrency: int = 16,
    seed: int = 0,
    headers: dict[str, str] | None = None,
    idle_timeout_s: float = 30.0,
) -> SoakReport:
    headers = headers or {}
    report = SoakReport(requests=num_requests)
    before = metrics(base_url, headers).get("vllm:num_preemptions_total", 0.0)
    rng = random.Random(seed)
    seeds = [rng.randint(0, 1 << 30) for _ in range(num_requests)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for s in seeds:
        queue.put_nowait(s)
    start = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=120, limits=limits
    ) as client:

        async def worker() -> None:
            while not queue.empty():
                outcome = await _one(client, random.Random(queue.get_nowait()), model)
                if outcome == "ok":
                    report.completed += 1
                elif outcome == "disconnect":
                    report.disconnects += 1
                elif outcome.startswith("status 4"):
                    report.client_errors += 1
                else:
                    if outcome.startswith("incomplete"):
                        report.incomplete += 1
                    else:
                        report.server_errors += 1
                    report.problems.append(outcome)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    report.seconds = round(time.monotonic() - start, 1)
    deadline = time.monotonic() + idle_timeout_s
    while True:
        m = metrics(base_url, headers)
        report.running_after = m["vllm:num_requests_running"]
        report.kv_usage_after = m["vllm:kv_cache_usage_perc"]
        idle = report.running_after == 0 and report.kv_usage_after == 0
        if idle or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    report.preemptions = int(m.get("vllm:num_preemptions_total", 0.0) - before)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="model folder (default: a tiny random-weight Qwen2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_qwen2(tmp)
        port = free_port()
        log = open(os.path.join(tmp, "serve.log"), "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", "qwenserve.entrypoints.cli", "serve", model,
               "--served-model-name", "soak", "--host", "127.0.0.1", "--port", str(port),
               *SERVER_FLAGS]  # fmt: skip
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        base_url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            report = asyncio.run(run_soak(base_url, "soak", args.requests, args.concurrency,
                                          args.seed))  # fmt: skip
            alive = httpx.get(base_url + "/health", timeout=10).status_code == 200
        finally:
            server.terminate()
            server.wait(timeout=60)
            log.close()
    print(json.dumps({**asdict(report), "problems": report.problems[:10],
                      "still_answering": alive, "clean": report.clean}, indent=2))  # fmt: skip
    return 0 if report.clean and alive else 1


if __name__ == "__main__":
    sys.exit(main())
