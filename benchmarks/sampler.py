"""The sampler's cost per decode step: PyTorch's draw vs the platform's native one.

    python benchmarks/sampler.py --rows 64 --vocab 151936 --threads 2

Rows of random logits (scale 3) through ``worker.sampler.sample`` with the parameter sets
servers see most: greedy, temperature 1 (``vllm bench serve``'s default), Qwen3's
generation_config (temperature 0.6, top_k 20, top_p 0.95), top_p alone and min_p. Medians of
wall time per call, both draws alternating in one process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qwenserve.native.kernels import sampling
from qwenserve.platforms.cpu import CpuPlatform
from qwenserve.sampling_params import SamplingParams
from qwenserve.worker.sampler import SamplingRow, sample

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "Qwen3 defaults (T 0.6, top_k 20, top_p 0.95)": dict(temperature=0.6, top_k=20, top_p=0.95),
    "top_p 0.8 alone (T 0.7)": dict(temperature=0.7, top_p=0.8),
    "min_p 0.1": dict(temperature=1.0, min_p=0.1),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    CpuPlatform().configure_process()  # the engine's allocator setting
    kernel = sampling()
    if kernel is None:
        raise SystemExit("the native sampling kernel did not build here")
    logits = 3 * torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0))
    print(f"{args.rows} rows x {args.vocab} vocab, {args.threads} threads\n")
    print("| parameters | PyTorch draw ms | native draw ms | speed-up |\n|---|---|---|---|")
    for name, kw in CASES.items():
        rows = [SamplingRow(SamplingParams(max_tokens=1, **kw), [1], [], None)] * args.rows
        times: dict[str, list[float]] = {"torch": [], "native": []}
        for _ in range(args.repeats + 1):  # the first round warms up
            for which, k in (("torch", None), ("native", kernel)):
                start = time.perf_counter()
                sample(logits, rows, kernel=k)
                times[which].append(time.perf_counter() - start)
        t, n = (statistics.median(times[w][1:]) * 1e3 for w in ("torch", "native"))
        print(f"| {name} | {t:.1f} | {n:.1f} | {t / n:.0f}x |")


if __name__ == "__main__":
    main()
