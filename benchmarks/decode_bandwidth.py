"""Batch-1 decode against this machine's weight-streaming bandwidth, measured in the same run.

A batch-1 decode step reads every weight once, so ``weight bytes / step time`` is the bandwidth
the step achieved; the machine's is a read-only reduction over a 1 GiB float32 tensor
(``torch.sum``, the same threads). Engines on the Qwen2.5-0.5B shape (random weights,
benchmarks/common.py), built once and measured in alternating rounds (median step time):

    fp32 native   decode GEMMs through native/csrc/gemv.cpp (the CPU default)
    fp32 oneDNN   the same model with the skinny route off (``skinny_gemm_max_rows = 0``)
    int8 native   ``--quantization int8`` (W8A8; on CPUs without VNNI every int8 GEMM is native)
    int8 oneDNN   W8A8 through the platform's oneDNN int8 GEMM at every row count (very slow
                  without VNNI)
    bf16          bfloat16 weights and activations (native/csrc/gemv.cpp at 1-2 rows where the
                  CPU has AVX512-BF16, native/csrc/bgemm.cpp on AMX CPUs up to 32 rows, packed
                  oneDNN GEMMs beyond and where bf16 is native without AMX)
    bf16 AMX      the same with the bf16 skinny route off (``bf16_skinny_gemm_max_rows = 0``)
    bf16 oneDNN   with both native bf16 routes off: oneDNN's packed GEMMs at every row count
    bf16 int8     ``--quantization int8`` with bfloat16 activations
    bf16 int8 oneDNN  the same through oneDNN's int8 GEMM at every row count
    bf16 eager / fp32 native eager  the first / second engine with ``enforce_eager``: every
                  step through the Python forward (the others replay recorded decode steps,
                  worker/decode_replay.py)

The default set is the three bf16 engines on CPUs with native bf16 (AMX / AVX512-BF16), where bf16 is the
mode users run, and the three fp32 engines elsewhere; ``--engines`` names any of them.

    PYTHONPATH=src python benchmarks/decode_bandwidth.py [--threads 2] [--steps 16] [--rounds 3]
    PYTHONPATH=src python benchmarks/decode_bandwidth.py --engines "bf16,bf16 int8" --batch 64
    PYTHONPATH=src python benchmarks/decode_bandwidth.py --threads 1 --cpu-time   # busy host
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN25_05B, cpu_model, random_model  # noqa: E402
from int8_decode import MAX_MODEL_LEN  # noqa: E402


def clock(cpu: bool) -> float:
    """Process CPU time (all threads) or wall time: on a machine shared with other work, CPU
    time at one thread is the figure that measures the work and not the scheduler."""
    return time.process_time() if cpu else time.perf_counter()


def read_bandwidth(cpu: bool, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of the fastest of ``repeats`` full reads of a 1 GiB float32 tensor by the
    current threads, each read both ways: ``torch.sum`` and the dot product of its two halves
    (MKL's sdot, which reads ~25% faster than torch.sum on the Emerald Rapids Xeon and as fast
    as a hand-written AVX512 read loop there)."""
    import torch

    big = torch.ones(int(gib * (1 << 30)) // 4)
    half = big.numel() // 2
    reads = (big.sum, lambda: torch.dot(big[:half], big[half:2 * half]))
    best = float("inf")
    for read in reads:
        read()
        for _ in range(repeats):
            start = clock(cpu)
            read()
            best = min(best, clock(cpu) - start)
    return big.numel() * 4 / best


def decode_steps(llm, prompt: list[int], steps: int, request_id: str, cpu: bool,
                 batch: int = 1) -> list[float]:
    """Seconds of each decode step of ``batch`` requests (their prefill steps not counted)."""
    from qwenserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{request_id}-{i}", [t + i for t in prompt], params)
    for _ in range(-(-batch * len(prompt) // 2048)):  # prefill steps (default token budget)
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        start = clock(cpu)
        engine.step()
        times.append(clock(cpu) - start)
    return times


ENGINES = ("fp32 native", "fp32 oneDNN", "int8 native", "int8 oneDNN", "bf16", "bf16 AMX",
           "bf16 oneDNN", "bf16 int8", "bf16 int8 oneDNN", "bf16 eager", "fp32 native eager")


def build(path: str, name: str):
    from qwenserve import LLM
    from qwenserve.platforms.cpu import CpuPlatform

    saved = (CpuPlatform.skinny_gemm_max_rows, CpuPlatform.int8_skinny_max_rows,
             CpuPlatform.amx_gemm_max_rows, CpuPlatform.bf16_skinny_gemm_max_rows)
    if name in ("bf16 AMX", "bf16 oneDNN"):
        CpuPlatform.bf16_skinny_gemm_max_rows = 0
    if name == "bf16 oneDNN":
        CpuPlatform.amx_gemm_max_rows = 0
    if name == "fp32 oneDNN":
        CpuPlatform.skinny_gemm_max_rows = 0
    if name.endswith("int8 oneDNN"):
        CpuPlatform.int8_skinny_max_rows = lambda self: 0
    try:
        quant = {"quantization": "int8"} if "int8" in name else {}
        dtype = "bfloat16" if name.startswith("bf16") else "float32"
        return LLM(path, dtype=dtype, max_model_len=MAX_MODEL_LEN,
                   enforce_eager=name.endswith("eager"), **quant)
    finally:
        (CpuPlatform.skinny_gemm_max_rows, CpuPlatform.int8_skinny_max_rows,
         CpuPlatform.amx_gemm_max_rows, CpuPlatform.bf16_skinny_gemm_max_rows) = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--engines", default=None,
                   help=f"comma-separated, from: {', '.join(ENGINES)} (default: see above)")
    p.add_argument("--batch", type=int, default=1,
                   help="concurrent requests per step (the bandwidth %% is for batch 1)")
    p.add_argument("--cpu-time", action="store_true",
                   help="process CPU time instead of wall time (use with --threads 1 on a busy host)")
    args = p.parse_args()
    import torch

    from qwenserve.platforms.cpu import CpuPlatform

    torch.set_num_threads(args.threads)
    path = random_model("qwen2.5-0.5b-random", **QWEN25_05B)
    if args.engines:
        names = [n.strip() for n in args.engines.split(",")]
        if unknown := [n for n in names if n not in ENGINES]:
            p.error(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    elif CpuPlatform().supports_native_bf16():
        names = ["bf16", "bf16 eager", "bf16 AMX", "bf16 oneDNN", "bf16 int8"]
    else:
        names = ["fp32 native", "fp32 native eager", "fp32 oneDNN", "int8 native"]
    engines = {name: build(path, name) for name in names}
    prompt = list(range(100, 100 + args.prompt_len))
    steps: dict[str, list[float]] = {name: [] for name in names}
    bandwidth: list[float] = []
    for r in range(args.rounds):
        bandwidth.append(read_bandwidth(args.cpu_time))
        for name in (names if r % 2 == 0 else list(reversed(names))):
            slow = name.endswith("int8 oneDNN") and not CpuPlatform._has_int8_dot()  # no VNNI
            n = 2 if slow else args.steps
            steps[name] += decode_steps(engines[name], prompt, n, f"{name}-{r}", args.cpu_time,
                                        args.batch)
    bw = statistics.median(bandwidth)
    print(f"CPU: {cpu_model()}, {args.threads} threads, torch {torch.__version__}; "
          f"{'process CPU' if args.cpu_time else 'wall'} time; batch {args.batch}")
    print(f"read bandwidth (torch.sum / dot over 1 GiB, median of {args.rounds}): {bw / 1e9:.1f} GB/s "
          f"(rounds: {', '.join(f'{b / 1e9:.1f}' for b in bandwidth)})")
    print("| engine | weight MiB | decode ms/step (median) | tok/s | weight GB/s | % of read BW |\n"
          "|---|---|---|---|---|---|")
    base = None
    for name in names:
        nbytes = engines[name].llm_engine.executor.weight_bytes()
        step = statistics.median(steps[name])
        base = base or step
        print(f"| {name} | {nbytes / 2**20:,.0f} | {step * 1e3:.1f} | {args.batch / step:.1f} | "
              f"{nbytes / step / 1e9:.1f} | {100 * nbytes / step / bw:.0f}% |")
    print(f"tok/s ratios vs {names[0]}: " + ", ".join(
        f"{name} {base / statistics.median(steps[name]):.2f}x" for name in names[1:]))



if __name__ == "__main__":
    main()
