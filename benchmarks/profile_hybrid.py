"""Where a hybrid (Qwen3.5, Gated DeltaNet) engine step's time goes, prefill-heavy and decode-heavy.

Runs ``vs_vllm_cpu.py``'s prompts (random tokens, greedy, ignore EOS) on the random-weight
``qwen3.5-0.8b`` shape of ``common.py`` and profiles steps of each kind with ``torch.profiler``. Every top-level op goes to one bucket: the GDN pieces (delta-rule core, conv1d,
gating, gated RMSNorm, metadata), the paged-attention core, the LM head and the sampler by the code
region it runs in (``record_function`` labels added here), the rest by name (GEMM or other ops).
What the ops do not cover is Python/scheduler overhead.

    PYTHONPATH=src python benchmarks/profile_hybrid.py [--dtype float32] [--threads 1]
        [--decode-batch 64] [--recurrent-backend NAME]
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
    from qwenserve.models import dense
    from qwenserve.worker import model_runner

    backend_cls.gated_delta_rule = _label(backend_cls.gated_delta_rule, LABELS[0])
    backend_cls.causal_conv1d = _label(backend_cls.causal_conv1d, LABELS[1])
    backend_cls.gating = _label(backend_cls.gating, LABELS[2])
    gated_norm.RMSNormGated.forward = _label(gated_norm.RMSNormGated.forward, LABELS[3])
    backend_cls.build_metadata = _label(backend_cls.build_metadata, LABELS[4])
    for name in attention._BACKENDS:
        cls = type(attention.get_attention_backend(name))
        cls.forward = _label(cls.forward, LABELS[5])
    dense.DenseForCausalLM.compute_logits = _label(dense.DenseForCausalLM.compute_logits,
                                                   LABELS[6])
    model_runner.ModelRunner._sample = _label(model_runner.ModelRunner._sample, LABELS[7])


def breakdown(prof, wall_s: float) -> dict[str, float]:
    """Seconds per bucket: a labelled region's whole span (native kernels inside it are no
    aten ops), else top-level ops by name (their children run inside them)."""
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        parent = ev.cpu_parent
        while parent is not None and parent.name not in LABELS:
            parent = parent.cpu_parent
        if parent is not None:  # inside a labelled region: counted with it
            continue
        if ev.name in LABELS:
            out[ev.name] += ev.cpu_time_total / 1e6
        elif ev.cpu_parent is None:
            name = "GEMM (projections, MLP)" if ev.name in GEMM_OPS else "other ops"
            out[name] += ev.cpu_time_total / 1e6
    out["python/scheduler overhead"] = max(0.0, wall_s - sum(out.values()))
    return dict(out)


def run_phase(engine, prompts: list[list[int]], output_len: int, kind: str, warm: int,
              profile_steps: int) -> tuple[list[float], list[tuple]]:
    """Run the requests to the end; profile ``profile_steps`` steps of ``kind`` after ``warm``.

    Returns (CPU seconds of every unprofiled step of that kind, [(profile, wall s, CPU s)])."""
    import torch

    from qwenserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{kind}-{i}", prompt, params)
    cpu_times: list[float] = []
    profiled: list[tuple] = []
    step = 0
    while engine.has_unfinished_requests():
        is_kind = (step == 0) if kind == "prefill" else (step > 0)
        want = is_kind and step >= warm and len(profiled) < profile_steps
        start, start_cpu = time.perf_counter(), time.process_time()
        if want:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                engine.step()
            profiled.append((prof, time.perf_counter() - start, time.process_time() - start_cpu))
        else:
            engine.step()
            if is_kind:
                cpu_times.append(time.process_time() - start_cpu)
        step += 1
    return cpu_times, profiled


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: CPU time is then steady on a loaded machine)")
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=6)
    p.add_argument("--recurrent-backend", default="", help="force one (default: the platform's)")
    p.add_argument("--phases", default="prefill,decode")
    args = p.parse_args()

    import torch
    from common import shaped_model
    from vs_vllm_cpu import NUM_REQUESTS, PROMPT_LEN, workload

    from qwenserve.layers import recurrent
    from qwenserve.platforms.cpu import CpuPlatform

    torch.set_num_threads(args.threads)
    name = args.recurrent_backend or CpuPlatform.default_recurrent_backend
    if args.recurrent_backend:
        CpuPlatform.default_recurrent_backend = name
    instrument(type(recurrent.get_recurrent_backend(name)))
    from qwenserve import LLM

    # eager steps: a replayed decode step runs none of the labelled modules
    llm = LLM(shaped_model("qwen3.5-0.8b"), dtype=args.dtype, max_model_len=1024,
              enable_prefix_caching=False, enforce_eager=True)
    engine = llm.llm_engine
    prompts = workload(argparse.Namespace(num_prompts=NUM_REQUESTS, input_len=PROMPT_LEN))
    # prefill-heavy: one step of 8 prompts x 256 tokens (2,048 tokens, the default step budget);
    # decode-heavy: a batch of one-token decodes after 16-token prompts (the GDN state and GEMM
    # costs of a decode step do not depend on the context length; attention's grows with it)
    phases = {}
    if "prefill" in args.phases:
        phases["prefill"] = run_phase(engine, prompts[: 2048 // PROMPT_LEN], 1, "prefill", 0, 1)
    if "decode" in args.phases:
        phases["decode"] = run_phase(engine, [p[:16] for p in prompts[: args.decode_batch]],
                                     args.decode_steps, "decode", 2, 2)
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"qwen3.5-0.8b shape, {args.dtype}, {torch.get_num_threads()} threads, recurrent "
          f"backend {name}")
    for kind, (cpu_times, profiled) in phases.items():
        total: dict[str, float] = defaultdict(float)
        wall = sum(w for _, w, _ in profiled)
        for prof, w, _ in profiled:
            for k, v in breakdown(prof, w).items():
                total[k] += v
        n = max(1, len(profiled))
        cpu = statistics.median(cpu_times or [c for _, _, c in profiled]) * 1e3
        what = "2,048 prompt tokens" if kind == "prefill" else f"batch {args.decode_batch}"
        print(f"\n{kind} step ({what}): CPU {cpu:.0f} ms (median, unprofiled); profiled "
              f"{len(profiled)} step(s), {wall / n * 1e3:.0f} ms wall each")
        print("| bucket | ms / step | share |\n|---|---|---|")
        for k, v in sorted(total.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v / n * 1e3:.1f} | {v / max(wall, 1e-9):.0%} |")


if __name__ == "__main__":
    main()
