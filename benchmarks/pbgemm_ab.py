"""bf16 GEMMs on packed weights, per shape and rows of x: oneDNN's packed kernel against the native
one of AVX512-BF16 CPUs without AMX (``native/csrc/pbgemm.cpp``), in one process, each weight
packed once for each (several copies of each weight in turn, so calls read memory as a model's
layers do). Qwen2.5-0.5B's shapes; median of ``--repeats`` calls, ms and GFLOP/s, rounds
alternating between the two.

    PYTHONPATH=src python benchmarks/pbgemm_ab.py [--rows 16,64,512,2048] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from packed_gemm import SHAPES, median_ms  # noqa: E402

from qwenserve.layers.native_gemm import with_packed_bf16_gemm  # noqa: E402
from qwenserve.platforms.cpu_packed_gemm import PackedFloatLinear  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="16,64,512,2048")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    native = with_packed_bf16_gemm(F.linear, True)
    if native is F.linear:
        sys.exit("the native packed bf16 GEMM does not build here (no AVX512-BF16)")
    kernels = {"oneDNN packed": PackedFloatLinear(torch.bfloat16), "native packed": native}
    print(f"{torch.get_num_threads()} threads; ms per call (median of each round), GFLOP/s of "
          "the best round")
    print("| shape | rows | oneDNN packed | native packed | speed-up |\n|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        copies = max(1, min(8, int(4e8 // (n * k * 2))))  # ~400 MB of bf16 copies at most
        weights = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            if rows * n <= 64 * 151936:  # no LM head at prefill sizes: a model never calls it
                print(f"| {name} {n}x{k} | {rows} | " + row(kernels, weights, rows, args))


def row(kernels: dict, weights: list[torch.Tensor], rows: int, args: argparse.Namespace) -> str:
    """One table row's cells: each kernel's per-round medians, alternating, and the speed-up."""
    n, k = weights[0].shape
    x = torch.randn(rows, k).bfloat16()
    times: dict[str, list[float]] = {label: [] for label in kernels}
    for _ in range(args.rounds):
        for label, kernel in kernels.items():
            times[label].append(median_ms(lambda i, f=kernel: f(x, weights[i]), len(weights),
                                          args.repeats))
    best = {label: min(ts) for label, ts in times.items()}
    cells = [" / ".join(f"{t:.3f}" for t in ts) + f" ms ({2 * rows * n * k / best[label] / 1e6:.0f})"
             for label, ts in times.items()]
    first, second = best.values()
    return " | ".join(cells) + f" | {first / second:.2f}x |"


if __name__ == "__main__":
    main()
