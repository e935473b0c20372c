"""GEMM routes per model shape: which kernel computes ``x @ W.T`` fastest on this CPU.

Shapes are the Qwen2.5-0.5B layers (qkv, o, gate_up, down, LM head) at M tokens. Each route
runs the same GEMM; the figure is CPU time per call (``time.process_time``, all threads, with
one torch thread, so other processes' load inflates it less than wall time), the minimum over
``--repeats`` alternating rounds:

    F.linear        torch's default (MKL sgemm on an [N, K] weight)
    onednn          oneDNN inner product on the plain weight (qwenserve's float_linear until now)
    mm_t            torch.mm on a weight transposed once to [K, N]
    mkl_packed      MKL packed sgemm (cblas_sgemm_pack at load; what inductor's freezing uses)
    onednn_packed   oneDNN with the weight reordered once to its blocked layout
    native          qwenserve.native's skinny GEMM (csrc/gemv.cpp; M <= 4 only), if built
    sgemm           qwenserve.native's blocked GEMM (csrc/sgemm.cpp; the weight read in place,
                    x packed per call), if built

With ``--dtype bfloat16`` x and W are bf16 and the routes those that take it: F.linear, onednn,
onednn_packed, ``native`` where the CPU has AVX512-BF16, and ``amx`` (qwenserve.native's AMX GEMM
for small batches, csrc/bgemm.cpp; the weight read in place), where the CPU has AMX.

With ``--int8`` the routes are the W8A8 GEMM's (int8 x int8 -> int32, as ``Int8Matmul`` runs
it): ``torch._int_mm`` (oneDNN) and the native kernel, against fp32 oneDNN on the same shape.

With ``--layers L`` every route cycles through L distinct copies of each weight, so that the
weight comes from memory as a model's layers do (one copy stays in cache); the figure is still
per call.

    python benchmarks/gemm_shapes.py [--m 1,16,64,256,2048] [--threads 1] [--int8]
        [--routes sgemm,native] [--gflops] [--layers 24] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qwenserve.native.gemm import bgemm, gemv, sgemm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_model  # noqa: E402

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864),
          "lm_head": (151936, 896)}  # name: (N out, K in)


def int8_routes(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """fp32 oneDNN on w, and the int8 GEMM of w's int8 copy (the input is quantized outside)."""
    w_q = torch.randint(-127, 128, w.shape, dtype=torch.int8)
    out = {"onednn": lambda x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
           "int_mm (s8)": lambda x: torch._int_mm(_q(x), w_q.t())}
    native = gemv()
    if native is not None:
        out["native (s8)"] = lambda x: native(_q(x), w_q)
    return out


def _q(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-1, 1).mul(127).to(torch.int8)


def routes(w: torch.Tensor, m: int, keep: set[str] | None = None
           ) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The routes on w for its dtype (those in keep; None: all), each weight layout made once
    here."""
    def wanted(route: str) -> bool:
        return keep is None or route in keep

    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "F.linear": lambda x: F.linear(x, w),
        "onednn": lambda x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
    }
    if wanted("mm_t"):
        wt = w.t().contiguous()
        out["mm_t"] = lambda x: torch.mm(x, wt)
    fp32 = w.dtype == torch.float32
    if wanted("mkl_packed") and fp32:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
        out["mkl_packed"] = lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, m)
    if wanted("onednn_packed"):
        blocked = torch.ops.mkldnn._reorder_linear_weight(w, m)
        out["onednn_packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x, blocked, None, "none", [], "")
    native = gemv()
    if (native is not None and m <= native.MAX_ROWS
            and native.supports(torch.empty(m, w.shape[1], dtype=w.dtype), w)):
        out["native"] = lambda x: native(x, w)
    blocked_native = sgemm()
    if blocked_native is not None and fp32:
        out["sgemm"] = lambda x: blocked_native(x, w)
    amx = bgemm()
    if amx is not None and amx.supports(torch.empty(m, w.shape[1], dtype=w.dtype), w):
        out["amx"] = lambda x: amx(x, w)
    return {r: fn for r, fn in out.items() if wanted(r)}


def in_turn(fns: list[Callable[[torch.Tensor], torch.Tensor]]
            ) -> Callable[[torch.Tensor], torch.Tensor]:
    """One route over several weights: each call runs the next one's."""
    turns = itertools.cycle(fns)
    return lambda x: next(turns)(x)


def cpu_time_per_call(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                      flops: float, min_calls: int = 2) -> float:
    calls = max(min_calls, min(200, int(2e9 / flops)))
    fn(x)
    t0 = time.process_time()
    for _ in range(calls):
        fn(x)
    return (time.process_time() - t0) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="1,16,64,256,2048")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--int8", action="store_true", help="the W8A8 routes instead of fp32's")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="of x and the weights (not with --int8)")
    p.add_argument("--routes", default="",
                   help="comma-separated fp32 routes to run (default: all; onednn always runs)")
    p.add_argument("--gflops", action="store_true",
                   help="a second row per shape with each route's GFLOP/s")
    p.add_argument("--layers", type=int, default=1,
                   help="distinct copies of each weight that every route cycles through")
    p.add_argument("--max-gflop", type=float, default=40.0,
                   help="skip (shape, M) pairs larger than this many GFLOP per call")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"CPU: {cpu_model()}, {args.threads} thread(s), torch {torch.__version__}; "
          "CPU ms per call (min of rounds), speed-up vs onednn in brackets")
    header = None
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        dtype = getattr(torch, args.dtype)
        weights = [(torch.randn(n, k) / k**0.5).to(dtype) for _ in range(args.layers)]
        w = weights[0]
        for m in map(int, args.m.split(",")):
            flops = 2.0 * m * n * k
            if flops > args.max_gflop * 1e9:
                continue
            x = torch.randn(m, k).to(dtype)
            keep = {"onednn", *args.routes.split(",")} if args.routes else None
            copies = [int8_routes(wi) if args.int8 else routes(wi, m, keep) for wi in weights]
            first = copies[0]  # checked on the first copy, timed over all of them in turn
            ref = F.linear(x.double(), w.double()).float()
            tolerance = 1e-3 if dtype == torch.float32 else 2e-2  # bf16 outputs: one rounding
            for route, fn in first.items():
                if "s8" in route:
                    assert torch.equal(fn(x), first["int_mm (s8)"](x)), f"{route} {name} M={m}"
                    continue
                err = (fn(x).float() - ref).abs().max().item()
                assert err < tolerance, f"{route} {name} M={m}: max error {err}"
            fns = {r: in_turn([c[r] for c in copies]) for r in first
                   if keep is None or r in keep}
            best: dict[str, float] = {r: float("inf") for r in fns}
            for rep in range(args.repeats):
                order = list(fns) if rep % 2 == 0 else list(reversed(fns))
                for route in order:
                    best[route] = min(best[route], cpu_time_per_call(fns[route], x, flops,
                                                                      max(2, 2 * args.layers)))
            if header is None:
                header = ["shape", "M", *fns]
                print("| " + " | ".join(header) + " | best GFLOP/s |\n|"
                      + "---|" * (len(header) + 1))
            base = best["onednn"]
            cells = [f"{best[r] * 1e3:.3f} ({base / best[r]:.2f}x)" if r in best else "-"
                     for r in header[2:]]
            gflops = flops / min(best.values()) / 1e9
            print(f"| {name} | {m} | " + " | ".join(cells) + f" | {gflops:.1f} |", flush=True)
            if args.gflops:
                print("|  | GFLOP/s | " + " | ".join(
                    f"{flops / best[r] / 1e9:.1f}" if r in best else "-" for r in header[2:])
                    + " |  |", flush=True)



if __name__ == "__main__":
    main()
