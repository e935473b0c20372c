"""One MoE layer forward, INT8 W8A8 experts against float32, on CPU (CPU time, one thread).

Qwen3-30B-A3B's MoE layer shape (hidden 2048, 128 experts of intermediate 768, top-8, no shared
expert), random weights; the INT8 layer holds the same weights quantized per channel
(``Int8Experts``: per-token dynamic activations, the platform's int8 GEMM). Both layers live in
one process and are called in alternation (float, int8, float, ...), so other load on the
machine hits both alike; each figure is the median CPU time (``time.process_time``) of
``--repeats`` calls, which counts this process's work only, not time spent waiting for a core.

    python benchmarks/moe_int8.py [--batches 1,64] [--repeats 7] [--experts 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(num_experts: int, hidden: int, inter: int, top_k: int):
    from qwenserve.layers.moe import SparseMoeBlock
    from qwenserve.platforms.cpu import CpuPlatform
    from qwenserve.quantization.expert_methods import Int8Experts
    from qwenserve.quantization.kernels import Int8Matmul, quantize_weight

    torch.manual_seed(0)
    fp32 = SparseMoeBlock(num_experts, top_k, hidden, inter).requires_grad_(False)
    int8 = SparseMoeBlock(num_experts, top_k, hidden, inter,
                          method=Int8Experts(Int8Matmul(CpuPlatform()))).requires_grad_(False)
    # the same int8 tensors through the dequantizing reference (no platform GEMM)
    ref = SparseMoeBlock(num_experts, top_k, hidden, inter,
                         method=Int8Experts(Int8Matmul(None))).requires_grad_(False)
    with torch.no_grad():
        fp32.gate.weight.normal_(0, 0.02)
        int8.gate.weight.copy_(fp32.gate.weight)
        for e in range(num_experts):  # expert by expert: no second full float copy
            for name in ("w13", "w2"):
                w = getattr(fp32.experts, name)[e]
                w.normal_(0, 0.02)
                q, scale = quantize_weight(w)
                getattr(int8.experts, name)[e].copy_(q)
                getattr(int8.experts, f"{name}_scale")[e].copy_(scale)
    ref.load_state_dict(int8.state_dict())
    return fp32, int8, ref


def cpu_seconds(layer, x: torch.Tensor) -> float:
    start = time.process_time()
    layer(x)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fp32, int8, ref = build(args.experts, args.hidden, args.intermediate, args.top_k)
    print(f"MoE layer: {args.experts} experts x (hidden {args.hidden}, intermediate "
          f"{args.intermediate}), top-{args.top_k}; 1 thread; median CPU ms of "
          f"{args.repeats} alternated calls")
    print("| tokens | fp32 ms | int8 GEMM ms | speed-up | int8 dequantizing reference ms | "
          "speed-up | max rel. diff int8 vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, args.hidden)
            want, got = fp32(x), int8(x)  # warm-up, and the int8 error for scale
            diff = ((got - want).abs().max() / want.abs().max()).item()
            ref(x)
            layers = {"fp32": fp32, "int8": int8, "ref": ref}
            times: dict[str, list[float]] = {name: [] for name in layers}
            for _ in range(args.repeats):
                for name, layer in layers.items():
                    times[name].append(cpu_seconds(layer, x))
            f, i, r = (statistics.median(times[k]) * 1e3 for k in layers)
            print(f"| {batch} | {f:.2f} | {i:.2f} | {f / i:.2f}x | {r:.2f} | {f / r:.2f}x "
                  f"| {diff:.4f} |")


if __name__ == "__main__":
    main()
