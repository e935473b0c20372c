"""Where one engine step's time goes: GEMM, LM head, attention, norms/elementwise, sampler and
Python/scheduler overhead, for a prefill-heavy and a decode-heavy step of the vs-vLLM workload.

Runs ``vs_vllm_cpu.py``'s workload (64 requests x 256 prompt tokens, 128 output tokens, greedy)
on a random-weight model of a ``common.py`` shape, times every step, and profiles a few steps of
each kind with ``torch.profiler``. Each top-level op's time is put in one bucket: the LM head,
attention and the sampler by the code region it runs in (``record_function`` labels added here),
the rest by the op's name. What the ops do not cover is Python/scheduler overhead.

    PYTHONPATH=src python benchmarks/profile_step.py --shape qwen2.5-0.5b --dtype float32
        [--native-gemm-min-rows 0]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm",
            "mkldnn::_linear_pointwise", "mkl::_mkl_linear", "aten::_int_mm")
LABELS = ("lm_head", "attention", "sampler")
# ctypes kernels show no torch op: their label's time goes to the elementwise bucket
ELEMENTWISE_LABEL = "fused elementwise"
GEMM_LABEL = "native gemm"  # csrc/gemv.cpp and csrc/sgemm.cpp (ctypes): the GEMM bucket


def _label(fn, name: str):
    import torch

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return wrapped


def instrument() -> None:
    """Label the LM head, every attention backend and the sampler for the profiler."""
    from qwenserve.layers import attention as attn
    from qwenserve.models import dense
    from qwenserve.worker import model_runner

    dense.DenseForCausalLM.compute_logits = _label(dense.DenseForCausalLM.compute_logits,
                                                   "lm_head")
    model_runner.ModelRunner._sample = _label(model_runner.ModelRunner._sample, "sampler")
    for name in attn._BACKENDS:
        cls = type(attn.get_attention_backend(name))
        cls.forward = _label(cls.forward, "attention")
    from qwenserve.native.kernels import Elementwise

    for name in ("rms_norm", "silu_and_mul", "rotary"):
        setattr(Elementwise, name, _label(getattr(Elementwise, name), ELEMENTWISE_LABEL))
    from qwenserve.native.kernels import Gemv, Sgemm

    for cls in (Gemv, Sgemm):
        cls.__call__ = _label(cls.__call__, GEMM_LABEL)


def top_level(prof):
    """Events that no other event encloses: ops outside any label, and the labels themselves
    (a label's time includes what no torch op shows, e.g. a native kernel called by ctypes)."""
    for ev in prof.events():
        if ev.device_type.name == "CPU" and ev.cpu_parent is None:
            yield ev


def breakdown(prof, wall_s: float, other_ops: dict[str, float]) -> dict[str, float]:
    """Seconds per bucket over the profiled steps. ``other_ops`` gathers the seconds of each
    op in the norms/elementwise bucket."""
    out: dict[str, float] = defaultdict(float)
    for ev in top_level(prof):
        seconds = ev.cpu_time_total / 1e6
        if ev.name in LABELS:
            out[ev.name] += seconds
        elif ev.name == ELEMENTWISE_LABEL:
            out["norms/elementwise/other ops"] += seconds
            other_ops[ev.name] += seconds
        elif ev.name in GEMM_OPS or ev.name == GEMM_LABEL:
            out["gemm"] += seconds
        else:
            out["norms/elementwise/other ops"] += seconds
            other_ops[ev.name] += seconds
    out["python/scheduler overhead"] = max(0.0, wall_s - sum(out.values()))
    return dict(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default=None, help="a model folder instead of --shape")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--profile-steps", type=int, default=2, help="steps profiled of each kind")
    p.add_argument("--native-gemm-min-rows", type=int, default=None,
                   help="override CpuPlatform.native_gemm_min_rows (0: the blocked native fp32 "
                        "GEMM off, for a before/after)")
    args = p.parse_args()
    if args.native_gemm_min_rows is not None:
        from qwenserve.platforms.cpu import CpuPlatform

        CpuPlatform.native_gemm_min_rows = args.native_gemm_min_rows

    import torch
    from common import shaped_model
    from vs_vllm_cpu import PROMPT_LEN, workload

    instrument()
    from qwenserve import LLM, SamplingParams

    llm = LLM(args.model or shaped_model(args.shape), dtype=args.dtype, max_model_len=1024)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    vocab = llm.llm_engine.config.model.hf_config.vocab_size
    prompts = workload(argparse.Namespace(input_len=PROMPT_LEN, num_prompts=args.requests))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), [t % vocab for t in prompt], params)
    times: dict[str, list[float]] = {"prefill": [], "decode": []}
    profiled: dict[str, list] = {"prefill": [], "decode": []}
    step, num_prefill_steps = 0, -(-args.requests * PROMPT_LEN // 2048)
    while engine.has_unfinished_requests():
        kind = "prefill" if step < num_prefill_steps else "decode"
        # profile prefill steps 1.. and decode steps from the middle of the decode phase
        decode_step = step - num_prefill_steps
        want = (kind == "prefill" and 1 <= step <= args.profile_steps) or (
            kind == "decode" and args.output_len // 2 <= decode_step
            < args.output_len // 2 + args.profile_steps)
        start = time.perf_counter()
        if want:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                engine.step()
            profiled[kind].append((prof, time.perf_counter() - start))
        else:
            engine.step()
            times[kind].append(time.perf_counter() - start)
        step += 1
    print(f"shape {args.shape}, dtype {args.dtype}, {torch.get_num_threads()} threads")
    result = {}
    for kind in ("prefill", "decode"):
        total: dict[str, float] = defaultdict(float)
        other_ops: dict[str, float] = defaultdict(float)
        wall = sum(w for _, w in profiled[kind])
        for prof, w in profiled[kind]:
            for k, v in breakdown(prof, w, other_ops).items():
                total[k] += v
        n = len(profiled[kind])
        print(f"\n{kind}: {len(times[kind])} unprofiled steps, median "
              f"{statistics.median(times[kind]) * 1e3:.0f} ms, sum {sum(times[kind]):.1f} s; "
              f"profiled {n} steps, {wall / n * 1e3:.0f} ms each")
        print("| bucket | ms / step | share |\n|---|---|---|")
        for k, v in sorted(total.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v / n * 1e3:.1f} | {v / wall:.0%} |")
        top = sorted(other_ops.items(), key=lambda kv: -kv[1])[:6]
        print("norms/elementwise, largest ops: " + ", ".join(
            f"{name} {v / wall:.0%}" for name, v in top))
        result[kind] = {"median_step_s": statistics.median(times[kind]),
                        "sum_s": sum(times[kind]), **{k: v / n for k, v in total.items()}}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
