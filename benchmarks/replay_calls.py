"""Where a replayed decode step's time goes, native call by native call.

Runs the vs-vLLM workload (``--requests`` prompts of ``--prompt-len`` random tokens, ``--output-len``
greedy tokens) on a random-weight model of ``--shape`` with decode steps recorded and replayed
(worker/decode_replay.py), timing every native call the replays make and every step the model
runner executes. Prints the median decode step, the replayed calls' share of it per entry point
(the rest: LM head, sampler, scheduler), and ``--eager`` for the same run without replays.

    PYTHONPATH=src python benchmarks/replay_calls.py --shape qwen3.5-0.8b [--dtype bfloat16]
    PYTHONPATH=src python benchmarks/replay_calls.py --shape qwen2.5-0.5b --quantization int8
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from common import shaped_model  # noqa: E402

from qwenserve import LLM, SamplingParams  # noqa: E402
from qwenserve.native import recording  # noqa: E402
from qwenserve.worker import decode_replay, model_runner  # noqa: E402

kernel_s: collections.Counter[str] = collections.Counter()
calls: collections.Counter[str] = collections.Counter()
replays = [0]
step_s: list[float] = []


def timed_replay(recorded: list[recording.NativeCall]) -> int | None:
    """``recording.replay``, each call timed by its entry point's name."""
    replays[0] += 1
    for i, call in enumerate(recorded):
        start = time.perf_counter()
        status = recording._base_call(call.fn, *call.args)
        kernel_s[call.fn.__name__] += time.perf_counter() - start
        calls[call.fn.__name__] += 1
        if status != call.result:
            return i
    return None


def timed_execute(execute):  # noqa: ANN001, ANN202
    def run(self, *args, **kwargs):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        out = execute(self, *args, **kwargs)
        step_s.append(time.perf_counter() - start)
        return out
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.5-0.8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--eager", action="store_true", help="--enforce-eager: no replays")
    p.add_argument("--quantization", default=None, help="e.g. int8 (W8A8, quantized at load)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    decode_replay.replay = timed_replay
    model_runner.ModelRunner.execute = timed_execute(model_runner.ModelRunner.execute)
    llm = LLM(shaped_model(args.shape), dtype=args.dtype, max_model_len=1024,
              enable_prefix_caching=False, enforce_eager=args.eager,
              quantization=args.quantization)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(args.prompt_len)]}
               for _ in range(args.requests)]
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    kernel_s.clear(), calls.clear(), step_s.clear()
    replays[0] = 0
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len,
                                         ignore_eos=True))
    total = time.perf_counter() - start
    decode = [s for s in step_s if s < 0.5]  # prefill steps of this workload take a second
    print(f"command: PYTHONPATH=src python {' '.join(sys.argv)}")
    print(f"total {total:.1f} s; {len(step_s)} steps, {len(decode)} decode steps, median "
          f"{statistics.median(decode) * 1e3:.1f} ms; {replays[0]} replayed")
    if replays[0]:
        n = replays[0]
        print(f"replayed calls {sum(kernel_s.values()) / n * 1e3:.1f} ms a replayed step:")
        for name, seconds in kernel_s.most_common():
            print(f"  {name:32s} {seconds / n * 1e3:7.2f} ms  ({calls[name] / n:.0f} calls)")


if __name__ == "__main__":
    main()
