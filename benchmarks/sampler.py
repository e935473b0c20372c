"""The sampler's cost per decode step: PyTorch's draw vs the platform's native one.

    python benchmarks/sampler.py --rows 64 --vocab 151936 --threads 2

Rows of random logits (scale 3) through ``worker.sampler.sample`` with the parameter sets
servers see most: greedy, temperature 1 (``vllm bench serve``'s default), Qwen3's
generation_config (temperature 0.6, top_k 20, top_p 0.95), Qwen2.5-Instruct's (the same with
repetition_penalty 1.05, which ``--generation-config auto`` puts on every request), top_p alone,
min_p, a presence penalty, logprobs=5 and a grammar's bitmask on every row (half the tokens
allowed). Rows carry a 256-token prompt and 100 output tokens (what the penalties read).
Medians of wall time per call, both draws alternating in one process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qwenserve.native.sampling import sampling
from qwenserve.platforms.cpu import CpuPlatform
from qwenserve.sampling_params import SamplingParams
from qwenserve.worker.sampler import SamplingRow, sample

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "Qwen3 defaults (T 0.6, top_k 20, top_p 0.95)": dict(temperature=0.6, top_k=20, top_p=0.95),
    "Qwen2.5 defaults (T 0.7, top_k 20, top_p 0.8, repetition 1.05)":
        dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
    "top_p 0.8 alone (T 0.7)": dict(temperature=0.7, top_p=0.8),
    "top_p 0.95 alone (T 1)": dict(temperature=1.0, top_p=0.95),
    "min_p 0.1": dict(temperature=1.0, min_p=0.1),
    "presence_penalty 0.5 (T 0.7, top_k 20)": dict(temperature=0.7, top_k=20,
                                                   presence_penalty=0.5),
    "greedy, logprobs 5": dict(temperature=0.0, logprobs=5),
    "greedy, a grammar's bitmask": dict(temperature=0.0),
}
GRAMMAR_CASES = {"greedy, a grammar's bitmask"}


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
    gen = torch.Generator().manual_seed(1)
    words = (args.vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (args.rows, words), generator=gen,
                            dtype=torch.int32)
    for name, kw in CASES.items():
        params = SamplingParams(max_tokens=200, **kw)
        rows = [SamplingRow(params, list(range(i, i + 256)), list(range(1000 + i, 1100 + i)),
                            None) for i in range(args.rows)]
        mask = bitmask if name in GRAMMAR_CASES else None
        times: dict[str, list[float]] = {"torch": [], "native": []}
        for _ in range(args.repeats + 1):  # the first round warms up
            for which, k in (("torch", None), ("native", kernel)):
                start = time.perf_counter()
                sample(logits, rows, bitmask=mask, kernel=k)
                times[which].append(time.perf_counter() - start)
        t, n = (statistics.median(times[w][1:]) * 1e3 for w in ("torch", "native"))
        print(f"| {name} | {t:.1f} | {n:.1f} | {t / n:.0f}x |")


if __name__ == "__main__":
    main()
