"""Prefix caching on against off, in one process: the vs-vLLM workload's time and step layout.

Two engines on the same random-weight model of ``--shape`` (bf16 by default), one with prefix
caching (the default) and one without, run the vs-vLLM workload (``--requests`` prompts of
``--prompt-len`` random tokens, ``--output-len`` greedy tokens) in alternating rounds, the cache
reset before each, after one untimed round each. ``--touch-kv`` writes the whole KV pool of both
engines first: it is allocated uninitialised, and the "on" engine's LRU eviction walks through
blocks no request has used yet (page faults) for many rounds, where "off" reuses the same ones.
Prints each round's time, the medians, and one round's step layout per engine
(prefill steps with their prompt tokens and decodes, and the decode-only steps): a hybrid model's
state checkpoints must not add steps (docs/benchmarks.md, "hybrid checkpoints saved mid-chunk").

    PYTHONPATH=src python benchmarks/prefix_caching_ab.py [--shape qwen3.5-0.8b] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import shaped_model  # noqa: E402

from qwenserve import LLM, SamplingParams  # noqa: E402
from qwenserve.core.sched_output import SchedulerOutput  # noqa: E402


def record_steps(llm: LLM, steps: list[tuple[int, int, float]]) -> None:
    """Append (prefill tokens, decodes, seconds) for every step the engine's executor runs."""
    executor = llm.llm_engine.executor
    run = executor.execute

    def timed(out: SchedulerOutput):
        start = time.perf_counter()
        result = run(out)
        sizes = [len(c.token_ids) for c in out.chunks]
        steps.append((sum(n for n in sizes if n > 1), sizes.count(1), time.perf_counter() - start))
        return result

    executor.execute = timed


def layout(steps: list[tuple[int, int, float]]) -> str:
    prefills = [s for s in steps if s[0]]
    decodes = [s[2] for s in steps if not s[0]]
    lines = [f"  {len(prefills)} prefill steps:"]
    lines += [f"    {p} prompt tokens + {d} decodes  {t:.3f} s" for p, d, t in prefills]
    if decodes:
        lines.append(f"  {len(decodes)} decode-only steps, {sum(decodes):.2f} s, median "
                     f"{statistics.median(decodes) * 1e3:.1f} ms")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.5-0.8b", help="a random-weight shape of common.py")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--touch-kv", action="store_true", help="write every KV page before timing")
    args = p.parse_args()
    path = shaped_model(args.shape)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(30000) for _ in range(args.prompt_len)]}
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engines = {name: LLM(path, dtype=args.dtype, max_model_len=1024,
                         enable_prefix_caching=name == "on") for name in ("on", "off")}
    for llm in engines.values():
        if args.touch_kv:
            for kv in llm.llm_engine.executor.worker.runner.caches.kv.values():
                kv.zero_()
        llm.generate(prompts, params)
    times: dict[str, list[float]] = {name: [] for name in engines}
    layouts: dict[str, list[tuple[int, int, float]]] = {}
    for r in range(args.rounds):
        for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
            llm = engines[name]
            llm.llm_engine.cache.reset_prefix_cache()
            steps: list[tuple[int, int, float]] = []
            if r == args.rounds - 1:
                record_steps(llm, steps)
            start = time.perf_counter()
            llm.generate(prompts, params)
            times[name].append(time.perf_counter() - start)
            print(f"round {r}: prefix caching {name} {times[name][-1]:.2f} s", flush=True)
            if steps:
                layouts[name] = steps
    print(f"\n{args.shape}, {args.dtype}, {args.requests} x {args.prompt_len} prompt tokens, "
          f"{args.output_len} out; {args.rounds} alternating rounds")
    for name in engines:
        print(f"prefix caching {name}: median {statistics.median(times[name]):.2f} s "
              f"({', '.join(f'{t:.2f}' for t in times[name])})")
        print(layout(layouts[name]))


if __name__ == "__main__":
    main()
