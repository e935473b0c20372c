"""A prefill's MLP in row chunks (``Platform.mlp_row_chunk``) vs all rows at once: the engine's
prefill of long prompts one at a time, side by side, with the chunk size switched per process.

Each run starts a fresh engine on a random-weight model of a ``common.py`` shape (prefix caching
off), prefills ``--prompts`` prompts of ``--prompt-len`` tokens one at a time (one output token),
and reports the medians of ``--rounds`` timed rounds; chunked and unchunked runs alternate.

    PYTHONPATH=src python benchmarks/mlp_row_chunks.py [--shape qwen2.5-0.5b] [--dtype bfloat16]
        [--prompt-len 1000] [--prompts 6] [--rounds 3] [--pairs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def run_one(args: argparse.Namespace, chunk: int) -> list[float]:
    """Seconds per round of prefills, in this process, MLP chunks of ``chunk`` rows (0: none)."""
    from common import SHAPES, random_model

    from qwenserve import LLM, SamplingParams
    from qwenserve.platforms.cpu import CpuPlatform

    CpuPlatform.mlp_row_chunk = chunk
    arch, shape = SHAPES[args.shape]
    path = random_model(f"{args.shape}-random", arch, **shape)
    llm = LLM(path, dtype=args.dtype, max_model_len=args.prompt_len + 8, max_num_seqs=1,
              max_num_batched_tokens=args.prompt_len + 8, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prompts(r: int) -> list[dict]:
        return [{"prompt_token_ids": [(7 * i + j + 1000 * r) % 150000
                                      for j in range(args.prompt_len)]}
                for i in range(args.prompts)]

    llm.generate(prompts(-1)[:1], params)  # warm-up: packing, kernels
    times = []
    for r in range(args.rounds):
        start = time.perf_counter()
        llm.generate(prompts(r), params)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pairs", type=int, default=2, help="alternating runs of each setting")
    p.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)  # a child run
    args = p.parse_args()
    if args.chunk is not None:
        print("RESULT " + json.dumps(run_one(args, args.chunk)))
        return
    from qwenserve.platforms.cpu import CpuPlatform

    settings = {"all rows at once": 0, f"chunks of {CpuPlatform.mlp_row_chunk}":
                CpuPlatform.mlp_row_chunk}
    results: dict[str, list[float]] = {name: [] for name in settings}
    child = sys.argv[1:]
    for _ in range(args.pairs):
        for name, chunk in settings.items():
            out = subprocess.run([sys.executable, __file__, *child, "--chunk", str(chunk)],
                                 capture_output=True, text=True, check=True).stdout
            line = next(s for s in out.splitlines() if s.startswith("RESULT "))
            results[name] += json.loads(line.removeprefix("RESULT "))
    print(f"{args.shape}, {args.dtype}: {args.prompts} prompts of {args.prompt_len} tokens, "
          "prefilled one at a time")
    base = statistics.median(results["all rows at once"])
    for name, times in results.items():
        med = statistics.median(times)
        print(f"  {name}: median {med:.2f} s ({', '.join(f'{t:.2f}' for t in times)}); "
              f"{base / med:.2f}x")


if __name__ == "__main__":
    main()
