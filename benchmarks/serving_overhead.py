"""Serving overhead: output tokens/s of `qwenserve serve` at N concurrent streaming clients vs
`LLM.generate` on the same requests, plus TTFT/ITL at low load (one client).

The server and the offline engine (a subprocess with the same engine flags and `max_num_seqs`
equal to the client concurrency, so both batch the same way) are both loaded, but never run at
the same time: measured rounds alternate A-B-B-A so that load from other processes drifting over
time hits both sides alike.

On a CPU shared with other busy processes, `--threads 1` is the fair setting: there the engine
running on the main thread (offline `LLM`) with 2 OpenMP threads was measured 5-20x slower than
the same engine on AsyncEngine's background thread, which would make the server look faster than
the offline engine. Requests are greedy with `ignore_eos`, so both generate exactly the
same number of tokens. Each side first runs the same workload once on other prompts (warm-up:
first-seen batch shapes are slow on CPU), then the measured run.

    python benchmarks/serving_overhead.py                        # embedded SmolLM2-135M
    python benchmarks/serving_overhead.py --model /path/to/qwen --num-requests 64
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

WORDS = (
    "the of and to in is was for on that with as by at from his her which an were are "
    "this be had not but have they one all their been has when who will more no if out "
    "so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down"
).split()


def make_prompts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = [
        "--max-model-len",
        str(args.max_model_len),
        "--kv-cache-memory-bytes",
        args.kv_cache,
        "--max-num-seqs",
        str(args.concurrency),
    ]
    return ([args.model] if args.model else []) + flags


def child_env(args: argparse.Namespace) -> dict[str, str]:
    """``--threads N`` pins both sides to N OpenMP threads (see the module docstring)."""
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


# ---- the server side ---------------------------------------------------------------------------
def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "qwenserve.entrypoints.cli",
        "serve",
        *engine_flags(args),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-log-requests",
        "--disable-uvicorn-access-log",
        "--disable-log-stats",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env(args)
    )
    base = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


async def stream_one(client, base: str, prompt: str, max_tokens: int) -> dict:
    payload = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps, tokens = [], 0
    async with client.stream("POST", base + "/v1/completions", json=payload) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {
        "ttft": stamps[0] - start,
        "itls": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "tokens": tokens,
        "end": stamps[-1],
    }


async def run_clients(
    base: str, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[float, list[dict]]:
    import httpx

    queue = list(enumerate(prompts))
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                _, prompt = queue.pop(0)
                results.append(await stream_one(client, base, prompt, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, results


def low_load(base: str, args: argparse.Namespace) -> dict:
    """TTFT and ITL with one client (requests one after another)."""
    prompts = make_prompts(args.low_load_requests, args.input_words, seed=7)
    _, single = asyncio.run(run_clients(base, prompts, 1, args.output_len))
    itls = [x for r in single for x in r["itls"]]
    return {
        "low_load_ttft_ms_median": 1000 * statistics.median(r["ttft"] for r in single),
        "low_load_ttft_ms_mean": 1000 * statistics.mean(r["ttft"] for r in single),
        "low_load_itl_ms_median": 1000 * statistics.median(itls),
        "low_load_itl_ms_mean": 1000 * statistics.mean(itls),
    }


def server_round(base: str, args: argparse.Namespace, seed: int) -> tuple[int, float]:
    prompts = make_prompts(args.num_requests, args.input_words, seed=seed)
    duration, results = asyncio.run(run_clients(base, prompts, args.concurrency, args.output_len))
    return sum(r["tokens"] for r in results), duration


# ---- the offline side: a subprocess that runs a round per line on stdin ------------------------
def offline_worker(args: argparse.Namespace) -> None:
    from qwenserve import LLM, SamplingParams

    llm = LLM(
        args.model,
        max_model_len=args.max_model_len,
        max_num_seqs=args.concurrency,
        kv_cache_memory_bytes=_size(args.kv_cache),
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    print("ready", flush=True)
    for line in sys.stdin:
        prompts = make_prompts(args.num_requests, args.input_words, seed=int(line))
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        duration = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps([tokens, duration]), flush=True)


def _size(value: str) -> int:
    from qwenserve.engine.arg_utils import human_readable_int

    return human_readable_int(value)


class OfflineWorker:
    def __init__(self, args: argparse.Namespace) -> None:
        flags = [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if v is not None and k != "offline_worker"
        ]
        cmd = [sys.executable, os.path.abspath(__file__), "--offline-worker", *flags]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=child_env(args),
        )
        while self.proc.stdout.readline().strip() != "ready":
            if self.proc.poll() is not None:
                raise RuntimeError("the offline worker failed to start")

    def round(self, seed: int) -> tuple[int, float]:
        self.proc.stdin.write(f"{seed}\n")
        self.proc.stdin.flush()
        tokens, duration = json.loads(self.proc.stdout.readline())
        return tokens, duration

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def measure(args: argparse.Namespace) -> dict:
    """Warm both up, then rounds in ABBA order (server, offline, offline, server, ...) so that
        load from other processes drifting over time hits both sides alike.

    On a CPU shared with other busy processes, `--threads 1` is the fair setting: there the engine
    running on the main thread (offline `LLM`) with 2 OpenMP threads was measured 5-20x slower than
    the same engine on AsyncEngine's background thread, which would make the server look faster than
    the offline engine."""
    proc, base = start_server(args)
    offline = OfflineWorker(args)
    try:
        server_round(base, args, seed=99)
        offline.round(99)
        totals = {"server": [0, 0.0], "offline": [0, 0.0]}
        for r in range(args.rounds):
            order = ("server", "offline") if r % 2 == 0 else ("offline", "server")
            for side in order:
                tokens, duration = (
                    server_round(base, args, r) if side == "server" else offline.round(r)
                )
                totals[side][0] += tokens
                totals[side][1] += duration
        result = low_load(base, args)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        offline.close()
    for side, (tokens, duration) in totals.items():
        result[f"{side}_output_tok_s"] = tokens / duration
        result[f"{side}_tokens"] = tokens
    result["server_vs_offline"] = result["server_output_tok_s"] / result["offline_output_tok_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-words", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--low-load-requests", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per side")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of both sides")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache", default="256M")
    parser.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offline_worker:
        return offline_worker(args)
    result = {**vars(args), **measure(args)}
    result.pop("offline_worker")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
