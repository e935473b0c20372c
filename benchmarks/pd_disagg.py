"""Prefill/decode disaggregation against one server: TTFT and output tokens/s.

Starts four processes on 127.0.0.1: a single server, a kv_producer, a kv_consumer and
``qwenserve disagg-proxy`` in front of the pair, then runs the same streamed greedy requests
(``ignore_eos``, so both sides generate the same tokens) against the single server and the
proxy: first one client at a time (TTFT: the P/D path adds the prefill leg's HTTP round trip
and the KV pull), then ``--concurrency`` clients. Rounds alternate single / P/D / P/D / single
so that drifting load from other processes hits both alike.

    python benchmarks/pd_disagg.py                       # embedded SmolLM2-135M
    python benchmarks/pd_disagg.py --model /path/to/qwen --prompt-words 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], log: str, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "qwenserve.entrypoints.cli", *argv],
                                stdout=f, stderr=subprocess.STDOUT, env=env)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: process exited ({proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready")


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int
              ) -> tuple[float, float, int]:
    """(ttft_s, e2e_s, output tokens) of one streamed completion."""
    model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start_t = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - start_t
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft or 0.0, time.perf_counter() - start_t, tokens


async def run(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def guarded(p: str) -> tuple[float, float, int]:
            async with sem:
                return await one(client, url, p, max_tokens)

        start_t = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        wall = time.perf_counter() - start_t
    ttfts = [r[0] for r in results]
    return {"ttft_mean_ms": 1000 * statistics.mean(ttfts),
            "ttft_median_ms": 1000 * statistics.median(ttfts),
            "output_tok_s": sum(r[2] for r in results) / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    env = {**os.environ, "QWENSERVE_LOGGING_LEVEL": "WARNING"}
    common = ([args.model] if args.model else []) + [
        "--max-model-len", "1024", "--kv-cache-memory-bytes", "256M",
        "--disable-uvicorn-access-log"]
    ports = {k: free_port() for k in ("single", "producer", "consumer", "proxy")}
    kv = {"kv_connector": "MooncakeConnectorV1", "engine_id": "p0"}
    procs = {
        "single": start(["serve", *common, "--port", str(ports["single"])], "/tmp/pd_single.log",
                        env),
        "producer": start(["serve", *common, "--port", str(ports["producer"]),
                           "--kv-transfer-config", json.dumps(
                               {**kv, "kv_role": "kv_producer", "kv_port": free_port()})],
                          "/tmp/pd_producer.log", env),
        "consumer": start(["serve", *common, "--port", str(ports["consumer"]),
                           "--kv-transfer-config", json.dumps(
                               {**kv, "kv_role": "kv_consumer", "engine_id": "d0"})],
                          "/tmp/pd_consumer.log", env),
    }
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    try:
        for name in procs:
            wait_ready(urls[name], procs[name])
        procs["proxy"] = start(["disagg-proxy", "--prefill", urls["producer"], "--decode",
                                urls["consumer"], "--port", str(ports["proxy"])],
                               "/tmp/pd_proxy.log", env)
        wait_ready(urls["proxy"], procs["proxy"])
        rng = random.Random(0)
        words = "the of and to in is was for on that with as by at from which an were".split()

        def prompts(n: int) -> list[str]:
            return [" ".join(rng.choice(words) for _ in range(args.prompt_words))
                    for _ in range(n)]

        for target in ("single", "proxy"):  # warm-up: first-seen shapes are slow on CPU
            asyncio.run(run(urls[target], prompts(2), args.max_tokens, 2))
        results: dict[str, list[dict]] = {"single": [], "proxy": []}
        for conc in (1, args.concurrency):
            batch = prompts(args.num_requests)
            for target in ("single", "proxy", "proxy", "single"):
                r = asyncio.run(run(urls[target], batch, args.max_tokens, conc))
                results[target].append({"concurrency": conc, **r})
        for conc in (1, args.concurrency):
            row = {}
            for target in ("single", "proxy"):
                runs = [r for r in results[target] if r["concurrency"] == conc]
                row[target] = {k: round(statistics.mean(r[k] for r in runs), 1)
                               for k in ("ttft_median_ms", "output_tok_s")}
            print(json.dumps({"concurrency": conc, **row,
                              "pd_over_single_tok_s": round(row["proxy"]["output_tok_s"]
                                                            / row["single"]["output_tok_s"], 2),
                              "pd_ttft_ratio": round(row["proxy"]["ttft_median_ms"]
                                                     / row["single"]["ttft_median_ms"], 2)}))
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
