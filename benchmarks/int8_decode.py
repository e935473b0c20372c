"""INT8 W8A8 (``--quantization int8``) against float32 on CPU: weight memory and batch-1 decode.

Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate 4864, vocab
151936, tied embeddings), random weights (benchmarks/common.py, built once, no download). Both
engines are loaded in one process and measured in alternation (float, int8, float, int8, ...),
so load from other processes on the machine hits both alike; each figure is a median. Each
thread count is measured in turn (default: 1 and all cores): on a host whose cores are busy with
other work, every multi-threaded GEMM waits for its worker threads to be scheduled.

    python benchmarks/int8_decode.py [--repeats 3] [--steps 16] [--prompt-len 32] [--threads 1,2]
    python benchmarks/int8_decode.py --repeats 5 --max-repeats 15   # pairs until stable

The speed-up is reported per alternated pair with its spread (quartiles, min-max): on a busy
host single pairs range widely, and a median of three is not a figure. ``--max-repeats`` keeps
adding pairs while the interquartile range exceeds ``--stable-within`` of the median.
    python benchmarks/int8_decode.py --kernels [--threads 1]   # the per-shape GEMM choice
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN25_05B, random_model  # noqa: E402

MAX_MODEL_LEN = 256


def weight_bytes(llm) -> tuple[int, int]:
    """(all weights, the decoder's linear layers) in bytes."""
    model = llm.llm_engine.executor.worker.model
    linear = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                 if "_proj." in name)
    return llm.llm_engine.executor.weight_bytes(), linear


def decode_step_seconds(llm, prompt: list[int], steps: int, request_id: str) -> list[float]:
    """Time each decode step of one request (the prefill step is not counted)."""
    from qwenserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    engine.step()  # prefill + first token
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def kernel_table(thread_counts: list[int]) -> None:
    """One linear layer per call, fp32 GEMM vs the W8A8 int8 path (activation quantization +
    int8 GEMM + rescale) vs dequantizing the weight on the fly; six weight copies in turn so
    that every call reads its weight from memory, as in a model. Minimum of 12 calls each,
    the three interleaved."""
    import torch

    from qwenserve.quantization.kernels import quantize_weight

    print("\n| layer | threads | rows | fp32 ms | int8 GEMM ms | dequantize on the fly ms |")
    print("|---|---|---|---|---|---|")
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for n, k, label in ((9728, 896, "gate_up 9728x896"), (896, 4864, "down 896x4864")):
            weights = [torch.randn(n, k) * 0.02 for _ in range(6)]  # [N, K] each
            quantized = [quantize_weight(w) for w in weights]
            for rows in (1, 16, 128, 512):
                best = _kernel_times(torch.randn(rows, k), weights, quantized)
                print(f"| {label} | {threads} | {rows} | {best['fp32']:.2f} | {best['int8']:.2f} "
                      f"({best['fp32'] / best['int8']:.1f}x) | {best['deq']:.2f} "
                      f"({best['fp32'] / best['deq']:.2f}x) |")


def _kernel_times(x, weights, quantized) -> dict[str, float]:
    """Best milliseconds of each way to compute x [M, K] @ W.T."""
    import torch
    import torch.nn.functional as F

    from qwenserve.platforms.cpu import CpuPlatform
    from qwenserve.quantization.kernels import int8_mm_reference, quantize_per_token

    cpu = CpuPlatform()

    def int8(i: int, mm=cpu.int8_scaled_mm):
        x_q, token_scale = quantize_per_token(x)
        w_q, scale = quantized[i % len(quantized)]
        return mm(x_q, w_q, scale.view(-1), token_scale, None, torch.float32)

    fns = {"fp32": lambda i: F.linear(x, weights[i % len(weights)]), "int8": int8,
           "deq": lambda i: int8(i, int8_mm_reference)}
    best = dict.fromkeys(fns, float("inf"))
    for i in range(12):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(i)
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="alternated pairs, at least")
    parser.add_argument("--max-repeats", type=int, default=None,
                        help="keep adding pairs up to this many until the spread is small")
    parser.add_argument("--stable-within", type=float, default=0.1,
                        help="stop once the speed-ups' interquartile range <= this x median")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per repeat")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", default=None,
                        help="comma-separated torch thread counts (default: 1 and all cores)")
    parser.add_argument("--kernels", action="store_true",
                        help="time single linear layers (the kernel choice) instead")
    args = parser.parse_args()
    import torch

    from qwenserve import LLM

    thread_counts = ([int(t) for t in args.threads.split(",")] if args.threads
                     else sorted({1, torch.get_num_threads()}))
    if args.kernels:
        kernel_table(thread_counts)
        return
    path = random_model("qwen2.5-0.5b-random", **QWEN25_05B)
    engines = {name: LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN,
                         kv_cache_memory_bytes=64 << 20, quantization=quant)
               for name, quant in (("float32", None), ("int8", "int8"))}
    prompt = list(range(1000, 1000 + args.prompt_len))
    print(f"\nQwen2.5-0.5B shape, random weights, batch 1, {args.prompt_len}-token prompt, "
          f"{args.repeats} x {args.steps} decode steps per engine, engines alternated; medians")
    for threads in thread_counts:
        torch.set_num_threads(threads)
        steps: dict[str, list[float]] = {name: [] for name in engines}
        pair_speedups: list[float] = []
        rep = 0
        while rep < args.repeats or (rep < (args.max_repeats or 0)
                                     and not stable(pair_speedups, args.stable_within)):
            medians = {}
            for name, llm in engines.items():
                times = decode_step_seconds(llm, prompt, args.steps, f"{name}-{threads}-{rep}")
                steps[name] += times
                medians[name] = statistics.median(times)
            pair_speedups.append(medians["float32"] / medians["int8"])
            rep += 1
        report(engines, steps, pair_speedups, threads)
    print(f"\ncommand: python benchmarks/int8_decode.py --repeats {args.repeats} "
          f"--max-repeats {args.max_repeats or args.repeats} --steps "
          f"{args.steps} --prompt-len {args.prompt_len} --threads "
          f"{','.join(map(str, thread_counts))}")


def report(engines, steps, pair_speedups, threads: int) -> None:
    rows, base = [], None
    for name, llm in engines.items():
        total, linear = weight_bytes(llm)
        tok_s = 1.0 / statistics.median(steps[name])
        base = base or (total, linear, tok_s)
        rows.append(f"| {name} | {threads} | {total / 2**20:,.0f} MiB ({total / base[0]:.2f}x) | "
                    f"{linear / 2**20:,.0f} MiB ({linear / base[1]:.2f}x) | {tok_s:.2f} "
                    f"({tok_s / base[2]:.2f}x) |")
    print("\n| weights | threads | all weights | linear layers | decode tokens/s |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    q1, med, q3 = quartiles(pair_speedups)
    print(f"\nint8 / float32 decode speed over {len(pair_speedups)} alternated pairs: median "
          f"{med:.2f}x, quartiles {q1:.2f}-{q3:.2f}, range {min(pair_speedups):.2f}-"
          f"{max(pair_speedups):.2f} (each pair: "
          f"{', '.join(f'{s:.2f}' for s in pair_speedups)})")


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, med, q3


def stable(values: list[float], within: float) -> bool:
    """Enough pairs (5+) whose interquartile range is within ``within`` of their median."""
    if len(values) < 5:
        return False
    q1, med, q3 = quartiles(values)
    return q3 - q1 <= within * med


if __name__ == "__main__":
    main()
