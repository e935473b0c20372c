"""An MLP's gate_up GEMM with SiLU-and-mul in the AMX kernel's epilogue (``Bgemm.silu_mul``)
against the unfused path (the same kernel's GEMM, then elementwise.cpp's SiLU-and-mul), bf16:

- ``kernel``: one gate_up call per layer of 24 distinct Qwen2.5-0.5B-shaped weights (9728 x 896,
  418 MB: streamed from memory, as in a decode step), per row count, the two alternating;
- ``engine``: the vs-vLLM offline workload (64 x 256-token prompts, 128 output tokens, greedy)
  on a random-weight model of ``--shape``, the engine built once and its MLPs switched between
  the two in alternating rounds; total time and the median decode step.

Both paths give the same bits (tests/native/test_bgemm_silu_mul.py), so only time differs.
Needs an AMX CPU.

    PYTHONPATH=src python benchmarks/fused_mlp.py [--parts kernel,engine] [--rows 2,8,16,32,64,96]
        [--shape qwen2.5-0.5b] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_model, shaped_model  # noqa: E402


def kernel_part(rows: list[int], rounds: int) -> None:
    from qwenserve.native.elementwise import elementwise
    from qwenserve.native.gemm import bgemm

    gemm, ew = bgemm(), elementwise()
    if gemm is None or ew is None:
        raise SystemExit("needs the AMX GEMM and the elementwise kernels (an AMX CPU, a compiler)")
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(9728, 896, generator=gen) * 0.05).bfloat16() for _ in range(24)]
    print("| rows | unfused us a call | fused us a call | unfused / fused |\n|---|---|---|---|")
    for m in rows:
        x = torch.randn(m, 896, generator=gen).bfloat16()
        paths = {"unfused": lambda x=x: [ew.silu_and_mul(gemm(x, w)) for w in weights],
                 "fused": lambda x=x: [gemm.silu_mul(x, w) for w in weights]}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for r in range(2 * rounds + 1):  # round 0 warms up
            for name in (("fused", "unfused") if r % 2 else ("unfused", "fused")):
                start = time.perf_counter()
                paths[name]()
                if r:
                    times[name].append((time.perf_counter() - start) / len(weights) * 1e6)
        unfused, fused = (statistics.median(times[n]) for n in ("unfused", "fused"))
        print(f"| {m} | {unfused:.0f} | {fused:.0f} | {unfused / fused:.3f} |", flush=True)


def engine_part(shape: str, rounds: int) -> None:
    from qwenserve import LLM, SamplingParams
    from qwenserve.models.dense import MLP

    llm = LLM(shaped_model(shape), dtype="bfloat16", max_model_len=1024,
              max_num_batched_tokens=2048)
    engine = llm.llm_engine
    mlps = [m for m in engine.executor.worker.model.modules() if isinstance(m, MLP)]
    fused = mlps[0].gate_up_silu
    if fused is None:
        raise SystemExit("this engine's MLPs have no fused kernel (no AMX tiles here)")
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    results: dict[str, list[tuple[float, float]]] = {"fused": [], "unfused": []}
    for r in range(rounds):
        for name in (("fused", "unfused") if r % 2 == 0 else ("unfused", "fused")):
            for mlp in mlps:
                mlp.gate_up_silu = fused if name == "fused" else None
            prompts = torch.randint(100, 50_000, (64, 256), generator=gen).tolist()
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{r}-{name}-{i}", prompt, params)
            steps = []
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            decode = statistics.median(steps[10:])  # past the 8 prefill steps and their tail
            results[name].append((sum(steps), decode))
            print(f"round {r} {name}: {sum(steps):.2f} s, decode step {decode * 1e3:.1f} ms",
                  flush=True)
    for name, runs in results.items():
        print(f"{name}: total {statistics.median(t for t, _ in runs):.2f} s, decode step "
              f"{statistics.median(d for _, d in runs) * 1e3:.1f} ms (medians of {rounds})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="kernel,engine")
    p.add_argument("--rows", default="2,8,16,32,64,96")
    p.add_argument("--shape", default="qwen2.5-0.5b", help="the engine part's common.py shape")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads")
    parts = args.parts.split(",")
    if "kernel" in parts:
        kernel_part([int(r) for r in args.rows.split(",")], args.rounds)
    if "engine" in parts:
        engine_part(args.shape, args.rounds)


if __name__ == "__main__":
    main()
