"""The fused elementwise kernels (``native/csrc/elementwise.cpp``) vs the PyTorch reference:
per kernel, and for whole engine steps of a random-weight model, measured side by side in one
process with before/after alternating.

Per kernel (the Qwen2.5-0.5B shape: hidden 896, intermediate 4864, 14/2 heads of 64; decode =
64 rows, prefill = 2,048 rows): CPU time at 1 thread (``time.process_time``) and wall time at
2 threads, median of ``--reps`` alternating pairs. Steps: 64 requests of ~300 tokens are
prefilled, then decode steps alternate fused/reference (the layers' ``kernels`` switched per
step); prefill steps of 2,048 tokens (8 new requests of 256) alternate the same way.

    PYTHONPATH=src python benchmarks/elementwise_kernels.py --shape qwen2.5-0.5b --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def timed(fn: Callable[[], object], threads: int) -> float:
    """Seconds of one call: CPU time at 1 thread (immune to other load), wall otherwise."""
    import torch

    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    start = clock()
    fn()
    return clock() - start


def side_by_side(ref: Callable[[], object], fused: Callable[[], object], reps: int,
                 threads: int) -> tuple[float, float]:
    """Median seconds of ref and fused over ``reps`` alternating pairs (order flipped each)."""
    ref(), fused()  # warm-up: caches, OpenMP pool, first-touch pages
    a, b = [], []
    for i in range(reps):
        if i % 2:
            b.append(timed(fused, threads))
            a.append(timed(ref, threads))
        else:
            a.append(timed(ref, threads))
            b.append(timed(fused, threads))
    return statistics.median(a), statistics.median(b)


def kernel_cases(dtype, kernels) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    import torch
    import transformers as tf

    from qwenserve.layers.activation import silu_and_mul
    from qwenserve.layers.norm import RMSNorm
    from qwenserve.layers.rotary import RotaryEmbedding

    hidden, inter, hq, hkv, d, layers = 896, 4864, 14, 2, 64, 24
    config = tf.Qwen2Config(hidden_size=hidden, num_attention_heads=hq, num_key_value_heads=hkv,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    ref_norm, fused_norm = RMSNorm(hidden, 1e-6, dtype), RMSNorm(hidden, 1e-6, dtype, kernels)
    ref_rope = RotaryEmbedding(config, d, d, 4096)
    fused_rope = RotaryEmbedding(config, d, d, 4096, kernels)
    cases = {}
    for rows in (64, 2048):
        x, res = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
        gate_up = torch.randn(rows, 2 * inter).to(dtype)
        qkv = torch.randn(rows, (hq + 2 * hkv) * d).to(dtype)
        q = qkv[:, : hq * d].view(rows, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d)
        pos = torch.randint(0, 4096, (rows,))
        # x `layers` calls: one model step's worth of each op
        cases[f"add + RMSNorm [{rows}, {hidden}] x{2 * layers}"] = (
            lambda x=x, r=res: [ref_norm(x, r) for _ in range(2 * layers)],
            lambda x=x, r=res: [fused_norm(x, r) for _ in range(2 * layers)])
        cases[f"SiLU-and-mul [{rows}, {2 * inter}] x{layers}"] = (
            lambda g=gate_up: [silu_and_mul(g) for _ in range(layers)],
            lambda g=gate_up: [silu_and_mul(g, kernels) for _ in range(layers)])
        cases[f"rotary q+k [{rows}, {hq}+{hkv}, {d}] x{layers}"] = (
            lambda q=q, k=k, p=pos: [ref_rope(p, q, k) for _ in range(layers)],
            lambda q=q, k=k, p=pos: [fused_rope(p, q, k) for _ in range(layers)])
    return cases


def toggle(model, kernels) -> None:
    """Point every layer of ``model`` at ``kernels`` (None: the PyTorch reference)."""
    from qwenserve.layers.norm import RMSNorm
    from qwenserve.layers.rotary import RotaryEmbedding
    from qwenserve.models.dense import MLP

    for m in model.modules():
        if isinstance(m, (RMSNorm, RotaryEmbedding)):
            m.kernels = kernels
        elif isinstance(m, MLP):
            m.fused = kernels


class Steps:
    """Forward passes of one random-weight model (the LM head included, the sampler not) on
    batches the model runner builds, the layers' kernels switched per call. The decodes' KV
    cache holds no real context (its values do not change the work), so no 19,200-token
    prefill is needed to reach ~300 tokens of context."""

    def __init__(self, args, kernels) -> None:
        import random

        from common import shaped_model

        from qwenserve import LLM, SamplingParams
        from qwenserve.core.sched_output import ScheduledChunk
        from qwenserve.worker.model_runner import RequestState

        self.llm = LLM(shaped_model(args.shape), dtype=args.dtype, max_model_len=1024)
        worker = self.llm.llm_engine.executor.worker
        self.model, self.runner, self.kernels = worker.model, worker.runner, kernels
        vocab = self.llm.llm_engine.config.model.hf_config.vocab_size
        bs, rng, params = self.runner.block_size, random.Random(0), SamplingParams()
        next_block = 1

        def request(rid: str, prompt_len: int, ctx: int) -> None:
            nonlocal next_block
            n = -(-(ctx + 1) // bs)
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            self.runner.requests[rid] = RequestState(prompt, [], params,
                                                     list(range(next_block, next_block + n)),
                                                     None, None)
            next_block += n

        self.decodes = []
        for i in range(64):
            request(f"d{i}", 300, 300)
            self.decodes.append(ScheduledChunk(f"d{i}", [rng.randrange(vocab)], 300, [], True))
        self.prefills = []
        per = 256
        for i in range(args.prefill_tokens // per):
            request(f"p{i}", per, per)
            self.prefills.append(ScheduledChunk(f"p{i}", self.runner.requests[f"p{i}"]
                                                .prompt_token_ids, 0, [], True))

    def _forward(self, chunks, fused: bool) -> None:
        import torch

        toggle(self.model, self.kernels if fused else None)
        with torch.inference_mode():
            batch = self.runner._prepare(chunks)
            hidden = self.model(batch.input_ids, batch.positions, batch, self.runner.caches)
            self.model.compute_logits(hidden[batch.logits_indices])

    def prefill(self, fused: bool) -> None:
        self._forward(self.prefills, fused)

    def decode(self, fused: bool) -> None:
        self._forward(self.decodes, fused)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--step-reps", type=int, default=4)
    p.add_argument("--no-steps", action="store_true", help="kernels only")
    p.add_argument("--no-kernels", action="store_true", help="steps only")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="a multiple of 256; 0: no prefill step")
    p.add_argument("--threads", default="1,2", help="1: CPU time; more: wall time")
    args = p.parse_args()

    import torch

    from qwenserve.native.elementwise import elementwise

    dtype = getattr(torch, args.dtype)
    kernels = elementwise()
    assert kernels is not None, "the native kernels did not build (see the log line)"
    thread_counts = [int(t) for t in args.threads.split(",")]
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, dtype {args.dtype}")
    heads = [f"{t} thread{'s' if t > 1 else ''} {'wall' if t > 1 else 'CPU'} ms: ref / fused / "
             "ratio" for t in thread_counts]
    print("| op (one model step's calls) | " + " | ".join(heads) + " |\n|---|"
          + "---|" * len(heads))
    result = {}

    def report(name, ref, fused, reps):
        row = []
        for threads in thread_counts:
            a, b = side_by_side(ref, fused, reps, threads)
            row.append(f"{a * 1e3:.1f} / {b * 1e3:.1f} / **{a / b:.2f}x**")
            result[f"{name} @{threads}t"] = (a, b)
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)

    for name, (ref, fused) in ({} if args.no_kernels else kernel_cases(dtype, kernels)).items():
        report(name, ref, fused, args.reps)
    if not args.no_steps:
        steps = Steps(args, kernels)
        report("decode step, 64 seqs x 300 ctx", lambda: steps.decode(False),
               lambda: steps.decode(True), args.step_reps)
        if steps.prefills:
            report(f"prefill step, {len(steps.prefills) * 256} tokens",
                   lambda: steps.prefill(False), lambda: steps.prefill(True),
                   max(2, args.step_reps // 2))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
