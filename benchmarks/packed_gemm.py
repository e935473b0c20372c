"""GEMMs on packed weights, per shape: bf16 (oneDNN, packed once) against int8 W8A8 through
``torch._int_mm`` (oneDNN reorders the plain weight each call) and through the packed int8 kernel
(``platforms/cpu_packed_gemm.py``). GEMM alone: activations already int8, no per-token quantization
or rescale (the model-level figure with both is ``decode_bandwidth.py --engines "bf16,bf16 int8"``).

Qwen2.5-0.5B's shapes (qkv, o, gate_up, down, LM head); several copies of each weight in turn so
that calls read memory as a model's layers do. Median of ``--repeats`` calls, milliseconds.
Needs a CPU with AMX / VNNI and AVX512-BF16 for the packed kernels to be the fast ones.

    PYTHONPATH=src python benchmarks/packed_gemm.py [--rows 1,16,64] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qwenserve.platforms.cpu_packed_gemm import PackedFloatLinear, PackedInt8Matmul

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864),
          "lm_head": (151936, 896)}


def median_ms(fn, copies: int, repeats: int) -> float:
    for i in range(copies):
        fn(i)  # packs each copy once, outside the timing
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i % copies)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bf16, int8 = PackedFloatLinear(torch.bfloat16), PackedInt8Matmul()
    print(f"{torch.get_num_threads()} threads; ms per call (median), speed-up vs bf16 packed")
    print("| shape | rows | bf16 packed | int8 `torch._int_mm` | int8 packed |\n|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        copies = max(1, min(8, int(4e8 // (n * k * 2))))  # ~400 MB of bf16 copies at most
        w_bf16 = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        w_int8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(copies)]
        scale = torch.rand(n) * 1e-2
        for rows in (int(r) for r in args.rows.split(",")):
            base, int_mm, packed = row_times(bf16, int8, rows, w_bf16, w_int8, scale,
                                             args.repeats)
            print(f"| {name} {n}x{k} | {rows} | {base:.3f} | {int_mm:.3f} ({base / int_mm:.2f}x) "
                  f"| {packed:.3f} ({base / packed:.2f}x) |")


def row_times(bf16: PackedFloatLinear, int8: PackedInt8Matmul, rows: int,
              w_bf16: list[torch.Tensor], w_int8: list[torch.Tensor], scale: torch.Tensor,
              repeats: int) -> tuple[float, float, float]:
    """Median ms of bf16 packed, int8 ``_int_mm`` and int8 packed at ``rows`` rows of x."""
    k, copies = w_bf16[0].shape[1], len(w_bf16)
    x = torch.randn(rows, k).bfloat16()
    x_q = torch.randint(-128, 128, (rows, k), dtype=torch.int8)
    return (median_ms(lambda i: bf16(x, w_bf16[i]), copies, repeats),
            median_ms(lambda i: torch._int_mm(x_q, w_int8[i].t()), copies, repeats),
            median_ms(lambda i: int8(x_q, w_int8[i], scale, None, None, torch.float32), copies,
                      repeats))

if __name__ == "__main__":
    main()
