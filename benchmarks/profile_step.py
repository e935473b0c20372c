"""Where one engine step's time goes, by layer part: GEMMs (per projection), attention, the Gated
DeltaNet pieces (hybrid models), norms/elementwise, LM head, sampler and Python overhead, for a
prefill-heavy and a decode-heavy step of the vs-vLLM workload.

Runs ``vs_vllm_cpu.py``'s prompts (random tokens, greedy, ignore EOS) on a random-weight model of a
``common.py`` shape and profiles a few steps of each kind with ``torch.profiler``. Code regions
carry ``record_function`` labels added here (the decoder's attention / MLP / norms, each GDN
layer's in_proj, conv1d, gating, delta-rule core, gated RMSNorm and out_proj, the LM head, the
sampler). Each op's own (self) time goes to its nearest enclosing label, split into that label's
GEMM part (inside a GEMM op) and the rest; a label's own time covers what no torch op shows
(native kernels called through ctypes, the Python in the region). Time outside every op is
Python/scheduler overhead. ``--threads 1`` makes CPU time steady on a shared machine.

    PYTHONPATH=src python benchmarks/profile_step.py --shape qwen2.5-0.5b --dtype float32
    PYTHONPATH=src python benchmarks/profile_step.py --shape qwen3.5-0.8b --threads 1 \\
        --phases decode --requests 64 --prompt-len 16
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
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm",
            "mkldnn::_linear_pointwise", "mkl::_mkl_linear", "aten::_int_mm")
GEMM_LABEL = "gemm (native)"  # the native skinny GEMM (ctypes: no torch op of its own)
PYTHON = "python/scheduler overhead"
LABELS: set[str] = {GEMM_LABEL}


def _label(fn: Callable, name: str) -> Callable:
    import torch

    LABELS.add(name)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return wrapped


def _wrap(cls: type, method: str, name: str) -> None:
    setattr(cls, method, _label(getattr(cls, method), name))


def instrument() -> None:
    """Label the regions (class attributes, so every layer's instance is covered)."""
    from qwenserve.layers import attention as attn
    from qwenserve.layers import norm, rotary
    from qwenserve.layers.embedding import VocabParallelEmbedding
    from qwenserve.layers.recurrent import base as rec_base
    from qwenserve.layers.recurrent import gated_norm
    from qwenserve.models import dense, qwen3_5, qwen3_5_layers
    from qwenserve.worker import model_runner

    _wrap(dense.DenseForCausalLM, "compute_logits", "lm head")
    _wrap(model_runner.ModelRunner, "_sample", "sampler")
    _wrap(VocabParallelEmbedding, "forward", "embedding")
    for name in attn._BACKENDS:
        _wrap(type(attn.get_attention_backend(name)), "forward", "attention: core")
    _wrap(dense.Attention, "forward", "attention layer")
    _wrap(qwen3_5.GatedAttention, "forward", "attention layer")
    _wrap(dense.MLP, "forward", "mlp")
    _wrap(norm.RMSNorm, "forward", "decoder norms")
    _wrap(rotary.RotaryEmbedding, "forward", "rotary")
    # Gated DeltaNet: the layer's glue (splits, reshapes) is its own label's time
    _wrap(qwen3_5.GatedDeltaNet, "forward", "gdn: glue")
    _wrap(qwen3_5_layers.GDNInProj, "forward", "gdn: in_proj")
    _wrap(gated_norm.RMSNormGated, "forward", "gdn: gated rmsnorm")
    from qwenserve.layers import recurrent

    for name in recurrent._BACKENDS:
        cls = type(recurrent.get_recurrent_backend(name))
        _wrap(cls, "gated_delta_rule", "gdn: delta-rule core")
        _wrap(cls, "causal_conv1d", "gdn: conv1d")
        _wrap(cls, "gating", "gdn: gating")
    _wrap(rec_base.RecurrentBackend, "build_metadata", "gdn: metadata")
    init = qwen3_5.GatedDeltaNet.__init__

    def gdn_init(self, *args, **kwargs) -> None:  # out_proj is a RowParallelLinear like others
        init(self, *args, **kwargs)
        self.out_proj.forward = _label(self.out_proj.forward, "gdn: out_proj")
    qwen3_5.GatedDeltaNet.__init__ = gdn_init
    from qwenserve.native import gemm

    for cls in (gemm.Gemv, gemm.Sgemm, gemm.Bgemm):  # native GEMMs: ctypes calls, no torch op
        _wrap(cls, "__call__", GEMM_LABEL)
    _wrap(gemm.Bgemm, "silu_mul", GEMM_LABEL)


def bucket_of(ev) -> str:
    """Nearest enclosing label (the event itself included), with ``[GEMM]`` when a GEMM op lies
    between; unlabelled ops: ``gemm (unlabelled)`` or ``other ops``."""
    gemm, node = False, ev
    while node is not None:
        if node.name in GEMM_OPS or node.name == GEMM_LABEL:
            gemm = True
        if node.name in LABELS and node.name != GEMM_LABEL:
            return f"{node.name} [GEMM]" if gemm else node.name
        node = node.cpu_parent
    return "gemm (unlabelled)" if gemm else "other ops"


def breakdown(prof, wall_s: float) -> dict[str, float]:
    """Seconds per bucket over one profiled step: every CPU event's self time to its bucket."""
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type.name == "CPU":
            out[bucket_of(ev)] += ev.self_cpu_time_total / 1e6
    out[PYTHON] = max(0.0, wall_s - sum(out.values()))
    return dict(out)


def run_phase(engine, prompts: list[list[int]], output_len: int, kind: str,
              profile_steps: int, warm: int) -> tuple[list[float], list[tuple]]:
    """Run the prompts to the end; profile ``profile_steps`` steps of ``kind`` (prefill: the
    steps that schedule prompt tokens; decode: from the middle of the decode phase, after
    ``warm`` decode steps). Returns (CPU s of each unprofiled step of that kind,
    [(profile, wall s, CPU s)])."""
    import torch

    from qwenserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{kind}-{i}", prompt, params)
    num_prefill_steps = -(-sum(map(len, prompts)) // 2048)
    cpu_times: list[float] = []
    profiled: list[tuple] = []
    step = 0
    while engine.has_unfinished_requests():
        is_kind = (step < num_prefill_steps) == (kind == "prefill")
        decode_step = step - num_prefill_steps
        want = is_kind and len(profiled) < profile_steps and (kind == "prefill"
                                                             or decode_step >= warm)
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


def report(kind: str, what: str, cpu_times: list[float], profiled: list[tuple]) -> dict:
    total: dict[str, float] = defaultdict(float)
    wall = sum(w for _, w, _ in profiled)
    for prof, w, _ in profiled:
        for k, v in breakdown(prof, w).items():
            total[k] += v
    n = max(1, len(profiled))
    cpu = statistics.median(cpu_times or [c for _, _, c in profiled])
    print(f"\n{kind} step ({what}): CPU {cpu * 1e3:.0f} ms (median of {len(cpu_times)} "
          f"unprofiled); profiled {len(profiled)} step(s), {wall / n * 1e3:.0f} ms wall, "
          f"{sum(c for _, _, c in profiled) / n * 1e3:.0f} ms CPU each")
    print("| bucket | ms / step | share |\n|---|---|---|")
    for k, v in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v / n * 1e3:.1f} | {v / max(wall, 1e-9):.1%} |")
    gemm = sum(v for k, v in total.items() if "GEMM" in k or k.startswith("gemm"))
    print(f"GEMM (all labels) {gemm / max(wall, 1e-9):.1%}, LM head included")
    return {"median_step_cpu_s": cpu, **{k: v / n for k, v in total.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default=None, help="a model folder instead of --shape")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--phases", default="prefill,decode")
    p.add_argument("--requests", type=int, default=64, help="decode phase: its batch")
    p.add_argument("--prompt-len", type=int, default=256, help="decode phase's prompts")
    p.add_argument("--output-len", type=int, default=16, help="decode phase's outputs")
    p.add_argument("--replay", action="store_true",
                   help="replay recorded decode steps (their time is then one unlabelled block)")
    p.add_argument("--profile-steps", type=int, default=2, help="steps profiled of each kind")
    args = p.parse_args()

    import torch
    from common import shaped_model
    from vs_vllm_cpu import NUM_REQUESTS, PROMPT_LEN, workload

    if args.threads:
        torch.set_num_threads(args.threads)
    instrument()
    from qwenserve import LLM

    # eager steps: the labels are per module, and a replayed decode step runs none of them
    llm = LLM(args.model or shaped_model(args.shape), dtype=args.dtype, max_model_len=1024,
              enable_prefix_caching=False, enforce_eager=not args.replay)
    engine = llm.llm_engine
    vocab = engine.config.model.hf_config.vocab_size
    prompts = [[t % vocab for t in p] for p in workload(
        argparse.Namespace(num_prompts=max(NUM_REQUESTS, args.requests), input_len=PROMPT_LEN))]
    run_phase(engine, [prompts[0][:32]], 2, "decode", 0, 0)  # warm-up: native libraries built
    print(f"command: PYTHONPATH=src python {' '.join(sys.argv)}")
    print(f"shape {args.shape}, dtype {args.dtype}, {torch.get_num_threads()} threads")
    result = {}
    if "prefill" in args.phases:  # one 2,048-token step: 8 prompts of 256
        n = 2048 // PROMPT_LEN
        result["prefill"] = report("prefill", f"{n} x {PROMPT_LEN} prompt tokens", *run_phase(
            engine, prompts[:n], 1, "prefill", 1, 0))
    if "decode" in args.phases:
        batch = [p[: args.prompt_len] for p in prompts[: args.requests]]
        result["decode"] = report(
            "decode", f"batch {args.requests}, context ~{args.prompt_len + args.output_len // 2}",
            *run_phase(engine, batch, args.output_len, "decode", args.profile_steps,
                       args.output_len // 2))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
