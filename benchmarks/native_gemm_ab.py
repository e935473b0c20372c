"""CPU-time A/B of whole engine runs: the same random-weight Qwen2.5-0.5B-shaped model (fp32) with
the blocked native GEMM (native/csrc/sgemm.cpp) off and on, two engines alternating in one process
at one torch thread (``time.process_time``: other processes' load inflates it far less than wall
time). Prefix caching is off so a repeated round recomputes its prompts.

    QWENSERVE_CPU_KVCACHE_SPACE=2 python benchmarks/native_gemm_ab.py
"""

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

torch.set_num_threads(1)
from common import shaped_model  # noqa: E402

from qwenserve import LLM, SamplingParams  # noqa: E402
from qwenserve.platforms.cpu import CpuPlatform  # noqa: E402

path = shaped_model("qwen2.5-0.5b")
llms = {}
for name, rows in (("oneDNN", 0), ("sgemm", 8)):
    CpuPlatform.native_gemm_min_rows = rows
    llms[name] = LLM(path, dtype="float32", max_model_len=1024, max_num_batched_tokens=2048,
                     enable_prefix_caching=False)
rng = random.Random(0)
pre = [[rng.randrange(150000) for _ in range(256)] for _ in range(8)]   # 2048 prefill tokens
dec = [[rng.randrange(150000) for _ in range(16)] for _ in range(32)]   # 32 seqs decode
runs = {"prefill 8x256, 1 out": (pre, 1), "decode 32 seqs x 16 in, 32 out": (dec, 32)}
best = {(r, n): 1e9 for r in runs for n in llms}
for rnd in range(2):
    for r, (prompts, out) in runs.items():
        for n in (llms if rnd % 2 == 0 else list(reversed(llms))):
            p = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
            t0 = time.process_time()
            llms[n].generate([{"prompt_token_ids": q} for q in prompts], p)
            best[(r, n)] = min(best[(r, n)], time.process_time() - t0)
            print(rnd, r, n, f"{best[(r, n)]:.2f} s CPU", flush=True)
print("| run | oneDNN s CPU | sgemm s CPU | speed-up |\n|---|---|---|---|")
for r in runs:
    a, b = best[(r, "oneDNN")], best[(r, "sgemm")]
    print(f"| {r} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
