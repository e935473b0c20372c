"""Paged decode attention alone (``native/csrc/decode_attention.cpp``): one decode step's calls
over every layer, with each layer's KV cache of its own (DRAM-sized, as in a model) and the
blocks of every sequence scattered over the pool, against the bytes of K and V it must read.

Qwen2.5-0.5B's attention (14 query / 2 KV heads of dim 64, 24 layers) by default; 64
sequences of 264 tokens, as the vs-vLLM workload's decode steps, their blocks shuffled over the
pool (``--contiguous``: side by side). Medians of ``--repeats`` steps.

    PYTHONPATH=src python benchmarks/decode_attention.py [--dtype bfloat16] [--seqs 64]
        [--context 264] [--layers 24] [--heads 14 --kv-heads 2 --head-dim 64] [--threads 2]
        [--kernels default,16-lane]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qwenserve.native.attention import decode_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=264)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--contiguous", action="store_true",
                   help="each sequence's blocks side by side (default: shuffled over the pool)")
    p.add_argument("--kernels", default="default",
                   help="comma-separated, run alternating in each repeat: default (the route: "
                        "AMX for grouped bf16 heads where the CPU has it, the 16-lane kernel for "
                        "fp32 on AVX512), amx, 16-lane (bf16: vdpbf16ps), generic (fp32: the "
                        "8-lane kernel)")
    p.add_argument("--amx-min-group", type=int, default=0,
                   help="query heads per KV head from which the AMX kernel runs (default: 2)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = decode_attention()
    assert kernel is not None, "the native kernel did not build"
    kinds = args.kernels.split(",")
    for kind in kinds:
        assert kind in ("default", "amx", "16-lane", "generic"), f"unknown kernel {kind!r}"

    def select(kind: str) -> None:
        assert kernel.use_amx(kind in ("default", "amx"), args.amx_min_group) or kind != "amx", \
            "no AMX kernel here"
        assert kernel.use_wide_f32(kind != "generic") or kind != "16-lane", "no AVX512 here"

    dtype = getattr(torch, args.dtype)
    bs, n, d = args.block_size, args.seqs, args.head_dim
    per_seq = -(-args.context // bs)
    blocks = n * per_seq + 8
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, blocks * bs, args.kv_heads, d, generator=gen).to(dtype)
              for _ in range(args.layers)]
    order = torch.arange(blocks) if args.contiguous else torch.randperm(blocks, generator=gen)
    tables = order[:n * per_seq].view(n, per_seq).contiguous()
    lens = torch.full((n,), args.context, dtype=torch.int64)
    q = torch.randn(n, args.heads, d, generator=gen).to(dtype)
    scale = d ** -0.5
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.repeats + 2):
        for kind in kinds:
            select(kind)
            start = time.perf_counter()
            for cache in caches:
                kernel(q, cache, tables, lens, bs, scale)
            times[kind].append(time.perf_counter() - start)
    select("default")
    kv_bytes = 2 * n * args.context * args.kv_heads * d * dtype.itemsize * args.layers
    flops = 4 * n * args.context * args.heads * d * args.layers
    for kind in kinds:
        step = statistics.median(times[kind][2:])
        print(f"{args.dtype}, {n} x {args.context} tokens, {args.layers} layers, "
              f"{args.heads}/{args.kv_heads} heads of {d}, {torch.get_num_threads()} threads, "
              f"{kind} kernel: {step * 1e3:.1f} ms a step, K+V {kv_bytes / step / 1e9:.1f} "
              f"GB/s, {flops / step / 1e9:.0f} GFLOP/s")

if __name__ == "__main__":
    main()
