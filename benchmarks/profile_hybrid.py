"""Where a hybrid (Qwen3.5, Gated DeltaNet) engine step's time goes, prefill-heavy and decode-heavy.

Runs ``vs_vllm_cpu.py``'s workload (requests of 256 random prompt tokens, greedy, ignore EOS) on the
random-weight ``qwen3.5-0.8b`` shape of ``common.py`` and profiles a few steps of each kind with
``torch.profiler``. Every top-level op goes to one bucket: the GDN pieces (delta-rule core, conv1d,
gating, gated RMSNorm, metadata), the paged-attention core, the LM head and the sampler by the code
region it runs in (``record_function`` labels added here), the rest by name (GEMM or other ops).
What the ops do not cover is Python/scheduler overhead.

    PYTHONPATH=src python benchmarks/profile_hybrid.py [--dtype float32] [--requests 16]
        [--output-len 16] [--recurrent-backend NAME]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul",
            "mkldnn::_linear_pointwise", "mkl::_mkl_linear", "aten::_int_mm")
LABELS = ("gdn: delta-rule core", "gdn: conv1d", "gdn: gating", "gdn: gated rmsnorm",
          "gdn: metadata", "full attention: paged core", "lm head", "sampler")


def _label(fn: Callable, name: str) -> Callable:
    import torch

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return wrapped


def instrument(backend_cls: type) -> None:
    """Label the regions above (class attributes, so every layer's instance is covered)."""
    from qwenserve.layers import attention
    from qwenserve.layers.recurrent import gated_norm
    from qwenserve.models import dense, qwen3_5
    from qwenserve.worker import model_runner

    backend_cls.gated_delta_rule = _label(backend_cls.gated_delta_rule, LABELS[0])
    backend_cls.causal_conv1d = _label(backend_cls.causal_conv1d, LABELS[1])
    qwen3_5.gdn_gating = _label(qwen3_5.gdn_gating, LABELS[2])
    gated_norm.RMSNormGated.forward = _label(gated_norm.RMSNormGated.forward, LABELS[3])
    backend_cls.build_metadata = _label(backend_cls.build_metadata, LABELS[4])
    for name in attention._BACKENDS:
        cls = type(attention.get_attention_backend(name))
        cls.forward = _label(cls.forward, LABELS[5])
    dense.DenseForCausalLM.compute_logits = _label(dense.DenseForCausalLM.compute_logits,
                                                   LABELS[6])
    model_runner.ModelRunner._sample = _label(model_runner.ModelRunner._sample, LABELS[7])


def breakdown(prof, wall_s: float) -> dict[str, float]:
    """Seconds per bucket: top-level ops only (their children run inside them)."""
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.name in LABELS:
            continue
        parent, label = ev.cpu_parent, None
        while parent is not None and parent.name in LABELS:
            label = label or parent.name
            parent = parent.cpu_parent
        if parent is not None:  # a child of another op: counted in its parent
            continue
        name = label or ("GEMM (projections, MLP)" if ev.name in GEMM_OPS else "other ops")
        out[name] += ev.cpu_time_total / 1e6
    out["python/scheduler overhead"] = max(0.0, wall_s - sum(out.values()))
    return dict(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--profile-steps", type=int, default=2, help="steps profiled of each kind")
    p.add_argument("--recurrent-backend", default="", help="force one (default: the platform's)")
    args = p.parse_args()

    import torch

    from common import shaped_model
    from vs_vllm_cpu import PROMPT_LEN, workload

    from qwenserve.layers import recurrent
    from qwenserve.platforms.cpu import CpuPlatform

    name = args.recurrent_backend or CpuPlatform.default_recurrent_backend
    if args.recurrent_backend:
        CpuPlatform.default_recurrent_backend = name
    instrument(type(recurrent.get_recurrent_backend(name)))
    from qwenserve import LLM, SamplingParams

    llm = LLM(shaped_model("qwen3.5-0.8b"), dtype=args.dtype, max_model_len=1024)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i, prompt in enumerate(workload()[: args.requests]):
        engine.add_request(str(i), prompt, params)
    times: dict[str, list[float]] = {"prefill": [], "decode": []}
    profiled: dict[str, list] = {"prefill": [], "decode": []}
    prefill_steps, step = -(-args.requests * PROMPT_LEN // 2048), 0
    while engine.has_unfinished_requests():
        kind = "prefill" if step < prefill_steps else "decode"
        want = len(profiled[kind]) < args.profile_steps and (
            kind == "prefill" or len(times["decode"]) >= min(4, args.output_len // 2))
        start = time.perf_counter()
        if want:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                engine.step()
            profiled[kind].append((prof, time.perf_counter() - start))
        else:
            engine.step()
            times[kind].append(time.perf_counter() - start)
        step += 1
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"qwen3.5-0.8b shape, {args.dtype}, {torch.get_num_threads()} threads, recurrent backend "
          f"{name}, {args.requests} requests x {PROMPT_LEN} prompt tokens")
    for kind in ("prefill", "decode"):
        total: dict[str, float] = defaultdict(float)
        wall = sum(w for _, w in profiled[kind])
        for prof, w in profiled[kind]:
            for k, v in breakdown(prof, w).items():
                total[k] += v
        n = max(1, len(profiled[kind]))
        med = statistics.median(times[kind]) * 1e3 if times[kind] else float("nan")
        print(f"\n{kind}: {len(times[kind])} unprofiled steps (median {med:.0f} ms); "
              f"profiled {len(profiled[kind])} steps, {wall / n * 1e3:.0f} ms each")
        print("| bucket | ms / step | share |\n|---|---|---|")
        for k, v in sorted(total.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v / n * 1e3:.1f} | {v / max(wall, 1e-9):.0%} |")


if __name__ == "__main__":
    main()
