"""CPU time per engine step in each process of ``qwenserve serve``: the API process and the
engine process, for N streaming requests decoding together on a tiny model (a ~1-ms step, so
what the server spends per token outside the model shows).

    python benchmarks/served_step_cost.py                          # 64 streams, tiny qwen2
    python benchmarks/served_step_cost.py --py-spy out/            # + where it goes (py-spy)

The client (raw HTTP streaming over httpx, token-id prompts so that every request has exactly
``--prompt-tokens``) runs in this process; only the server's two processes are measured, by
their CPU time (user + system, ``psutil``) over one measured round after a warm-up round, and
divided by the engine steps of that round (``vllm:iteration_tokens_total`` count). CPU time,
not wall time: it holds on a loaded machine. Both processes run one OpenMP thread.

With ``--py-spy DIR`` each process is sampled during the measured round (``py-spy record
--format raw``, idle frames left out) and the top self-time functions are printed; the
sampler costs CPU itself, so the CPU figures of such a run are not the ones to quote.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port, tiny_qwen2  # noqa: E402


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def _stream(client: httpx.AsyncClient, base: str, prompt: list[int],
                  max_tokens: int) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    chunks = 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
    return chunks


async def _round(base: str, prompts: list[list[int]], max_tokens: int) -> int:
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        counts = await asyncio.gather(*(_stream(client, base, p, max_tokens) for p in prompts))
    return sum(counts)


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _top_self(raw_path: Path, n: int) -> list[tuple[str, float]]:
    """The functions that most samples were in (self time), from py-spy's raw output."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        total += int(count)
        counts[stack.split(";")[-1]] += int(count)
    return [(frame, c / max(total, 1)) for frame, c in counts.most_common(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: a tiny random-weight Qwen2)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--py-spy", metavar="DIR", help="sample both processes into DIR")
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_qwen2(tmp)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "QWENSERVE_CPU_OMP_THREADS_BIND": "nobind"}
        log = open(os.path.join(tmp, "serve.log"), "w")  # noqa: SIM115 - closed below
        server = subprocess.Popen(
            [sys.executable, "-m", "qwenserve.entrypoints.cli", "serve", model,
             "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
             "--max-num-seqs", str(args.requests), "--max-model-len", "1024",
             "--disable-log-requests", "--seed", "0"],
            stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
        try:
            for _ in range(1200):
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    raise SystemExit(Path(log.name).read_text()[-3000:])
                time.sleep(0.5)
            api = psutil.Process(server.pid)
            engine = api.children()[0]
            vocab = 500

            def prompts() -> list[list[int]]:
                return [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
                        for _ in range(args.requests)]

            asyncio.run(_round(base, prompts(), 16))  # warm-up: first-seen shapes
            spies = []
            if args.py_spy:
                out = Path(args.py_spy)
                out.mkdir(parents=True, exist_ok=True)
                spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
                spies = [(name, out / f"{name}.txt", subprocess.Popen(
                    [spy, "record", "--pid", str(p.pid), "--format", "raw", "--rate", "250",
                     "--output", str(out / f"{name}.txt"), "--nonblocking"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    for name, p in (("api", api), ("engine", engine))]
                time.sleep(2)  # py-spy attaches
            steps0 = _metric(base, "vllm:iteration_tokens_total_count")
            api0, engine0 = _cpu_s(api), _cpu_s(engine)
            wall0 = time.perf_counter()
            chunks = asyncio.run(_round(base, prompts(), args.output_tokens))
            wall_s = time.perf_counter() - wall0
            api_s, engine_s = _cpu_s(api) - api0, _cpu_s(engine) - engine0
            steps = _metric(base, "vllm:iteration_tokens_total_count") - steps0
            for _, _, spy_proc in spies:
                spy_proc.send_signal(2)  # SIGINT: py-spy writes its file
                spy_proc.wait(60)
        finally:
            server.terminate()
            server.wait(60)
            log.close()
    tokens = args.requests * args.output_tokens
    print(f"{args.requests} streams x {args.prompt_tokens} prompt + {args.output_tokens} output "
          f"tokens: {steps:.0f} engine steps, {chunks} SSE chunks, {wall_s:.1f} s wall")
    # A reader that falls behind gets several steps' tokens as one chunk (fewer, larger
    # chunks), and the steps depend on how the requests arrived: compare per token and chunk.
    for name, cpu_s in (("API process", api_s), ("engine process", engine_s)):
        print(f"{name:>15}: {cpu_s:6.2f} s CPU = {1e3 * cpu_s / steps:6.2f} ms per step, "
              f"{1e6 * cpu_s / tokens:6.1f} us per output token, "
              f"{1e6 * cpu_s / max(chunks, 1):6.1f} us per SSE chunk")
    for name, path, _ in spies:
        print(f"\n{name}: top self time (share of samples)")
        for frame, share in _top_self(path, 25):
            print(f"  {100 * share:5.1f}%  {frame}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
