"""EAGLE-3 machinery overhead on a small random Qwen3: decode tokens/s at batch 1, plain vs
eagle3 with a random head (acceptance ~0: the draft + verify cost alone) vs the same head rigged
to propose the target's own continuation (acceptance ~100%: the upper bound). Greedy; the three
outputs are checked equal. No trained EAGLE-3 weights were available (nor a real Qwen3 on this
machine), so real acceptance is not measured here.

    PYTHONPATH=src python benchmarks/eagle3_overhead.py --max-tokens 64 --k 3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from helpers.tiny_models import make_eagle3_head, make_tiny_model  # noqa: E402
from qwenserve import LLM, SamplingParams  # noqa: E402
from qwenserve.spec_decode.eagle3 import Eagle3Proposer  # noqa: E402

PROMPT = list(range(10, 42))


class Rigged(Eagle3Proposer):
    expected: list[int] = []

    def choose(self, request_ids, rows, step, requests):
        super().choose(request_ids, rows, step, requests)  # the head's LM head still runs
        done = [len(requests[r].output_token_ids) + step for r in request_ids]
        return [self.expected[d] if d < len(self.expected) else 0 for d in done]


def run(llm: LLM, params: SamplingParams) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_args()
    root = tempfile.mkdtemp()
    target = make_tiny_model("qwen3", f"{root}/t", hidden_size=256, intermediate_size=768,
                             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4)
    head = make_eagle3_head(target, f"{root}/h", intermediate_size=768)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=512, block_size=16)
    plain = LLM(target, **kw)
    spec = LLM(target, speculative_config={"method": "eagle3", "model": head,
                                           "num_speculative_tokens": args.k}, **kw)
    run(plain, params), run(spec, params)  # warm
    expected, t_plain = run(plain, params)
    got, t_random = run(spec, params)
    assert got == expected
    totals = spec.llm_engine.scheduler.spec_totals
    random_acc = totals.num_accepted_tokens / max(totals.num_draft_tokens, 1)
    proposer = spec.llm_engine.executor.worker.runner.proposer
    proposer.__class__ = Rigged
    Rigged.expected = expected + [0] * (args.k + 1)
    before = (totals.num_draft_tokens, totals.num_accepted_tokens)
    got, t_rigged = run(spec, params)
    assert got == expected
    rigged_acc = (totals.num_accepted_tokens - before[1]) / max(
        totals.num_draft_tokens - before[0], 1)
    n = len(expected)
    print(f"batch 1, {n} tokens, k={args.k}, {os.cpu_count()} CPUs")
    print(f"plain          {n / t_plain:8.1f} tok/s")
    print(f"eagle3 random  {n / t_random:8.1f} tok/s  ({t_plain / t_random:.2f}x, "
          f"acceptance {random_acc:.1%})")
    print(f"eagle3 rigged  {n / t_rigged:8.1f} tok/s  ({t_plain / t_rigged:.2f}x, "
          f"acceptance {rigged_acc:.1%})")


if __name__ == "__main__":
    main()
