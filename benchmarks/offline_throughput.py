"""Offline throughput: qwenserve vs Hugging Face `generate` on a Qwen2.5-0.5B-shaped model (fp32).

Also measured in the same run: this CPU's fp32 matmul rate and how close batched decode comes to
it, engine start-up time, and time to first token with a 1,024-token prefix cached vs not.
Each measurement runs in its own subprocess so that each has its own peak RSS.

qwenserve runs float32 GEMMs through oneDNN and keeps freed memory in glibc's heap (its CPU
platform); stock HF gets MKL's ``F.linear`` and glibc's defaults. ``hf_*_same`` run HF with the
engine's GEMM and allocator settings too, so the ratio against them is the scheduler's (and
attention's) share alone.

    python benchmarks/offline_throughput.py                 # everything (HF static takes long)
    python benchmarks/offline_throughput.py --hf-static-batches 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    QWEN25_05B,
    install_engine_kernels,
    peak_rss_mib,
    resident_bytes,
    run_in_subprocess,
    shaped_model,
)

SCRIPT = os.path.abspath(__file__)
VOCAB = 151643  # ordinary tokens of the Qwen tokenizer


PROMPT_LENS = (16, 512)
OUTPUT_LENS = (8, 256)


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """n requests: prompt length uniform in 16-512, output length uniform in 8-256."""
    rng = random.Random(seed)
    return [([rng.randrange(VOCAB) for _ in range(rng.randint(*PROMPT_LENS))],
             rng.randint(*OUTPUT_LENS)) for _ in range(n)]


def model_path() -> str:
    return shaped_model(os.environ.get("QWENSERVE_BENCH_SHAPE", "qwen2.5-0.5b"))


# ---- workers (each in its own process) ---------------------------------------------------------
def worker_qwenserve(n: int) -> dict:
    from qwenserve import LLM, SamplingParams

    llm = LLM(model_path(), dtype="float32", max_model_len=1024)
    reqs = workload(n)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(o for _, o in reqs)
    kv = list(llm.llm_engine.executor.worker.runner.caches.kv.values())
    return {"output_tokens": produced, "requests": n,
            "prompt_tokens": sum(len(p) for p, _ in reqs), "seconds": elapsed,
            "peak_rss_mib": peak_rss_mib(),
            "kv_allocated_mib": sum(c.nbytes for c in kv) / 2**20,
            "kv_resident_mib": sum(resident_bytes(c.data_ptr(), c.nbytes) for c in kv) / 2**20}


def _hf_model():
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def worker_hf(n: int, batch: int, same_kernels: bool = False) -> dict:
    """HF generate in static batches of ``batch`` in arrival order (left padding); a batch runs
    until its longest request ends. ``batch=1`` is one request at a time. ``same_kernels``:
    with the engine's GEMM and allocator settings (``install_engine_kernels``)."""
    import torch

    if same_kernels:
        install_engine_kernels()
    model = _hf_model()
    reqs = workload(64)[:n]
    useful, start = 0, time.perf_counter()
    for i in range(0, n, batch):
        group = reqs[i : i + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
        longest = max(o for _, o in group)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                                 min_new_tokens=longest, do_sample=False)
        assert out.shape[1] == width + longest
        useful += sum(o for _, o in group)
    elapsed = time.perf_counter() - start
    return {"output_tokens": useful, "seconds": elapsed, "requests": n,
            "peak_rss_mib": peak_rss_mib()}


def worker_matmul() -> dict:
    """fp32 GEMM rate, of the GEMM the engine runs (the CPU platform's oneDNN linear; F.linear,
    i.e. MKL, for reference): a large square matmul and the decode shapes at 64 rows."""
    import torch

    from qwenserve.platforms.cpu import CpuPlatform

    engine_linear = CpuPlatform().float_linear() or torch.nn.functional.linear
    mkl = _gemm_rates(torch.nn.functional.linear)
    return {**_gemm_rates(engine_linear), **{"mkl_" + k: v for k, v in mkl.items()}}


def _gemm_rates(linear) -> dict:
    import torch

    def rate(m: int, k: int, n: int, reps: int = 20) -> float:
        a, b = torch.randn(m, k), torch.randn(n, k)
        for _ in range(3):
            linear(a, b)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            linear(a, b)
            times.append(time.perf_counter() - t)
        return 2 * m * k * n / statistics.median(times) / 1e9

    c = QWEN25_05B
    h, inter = c["hidden_size"], c["intermediate_size"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * h // c["num_attention_heads"]
    shapes = [(64, h, qkv), (64, h, h), (64, h, 2 * inter), (64, inter, h)]
    per_layer = [2 * 64 * k * n for m, k, n in shapes]
    # time-weighted rate over one layer's GEMMs at 64 rows (what a decode step runs)
    seconds = sum(f / (rate(m, k, n) * 1e9) for f, (m, k, n) in zip(per_layer, shapes))
    return {"gemm_2048_gflops": rate(2048, 2048, 2048, 5),
            "decode_shapes_64_gflops": sum(per_layer) / seconds / 1e9,
            # the LM head [64, h] x [h, vocab]: a third of a decode step's FLOPs on this shape
            "lm_head_64_gflops": rate(64, h, c["vocab_size"], 5)}


def worker_decode() -> dict:
    """Batched decode: 64 sequences of 16 prompt tokens decode 128 tokens each; GEMM FLOP/s
    achieved in decode-only steps (2 x matmul parameters x tokens / time)."""
    from qwenserve import LLM, SamplingParams

    llm = LLM(model_path(), dtype="float32", max_model_len=1024)
    engine = llm.llm_engine
    rng = random.Random(1)
    for i in range(64):
        engine.add_request(str(i), [rng.randrange(VOCAB) for _ in range(16)],
                           SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    engine.step()  # all prefills
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step()) or 64
    elapsed = time.perf_counter() - start
    c = QWEN25_05B
    h = c["hidden_size"]
    head = h // c["num_attention_heads"]
    per_layer = h * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head \
        + h * h + 3 * h * c["intermediate_size"]
    layers, lm_head = c["num_hidden_layers"] * per_layer, c["vocab_size"] * h
    tokens = 64 * 127
    return {"decode_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "gflops": 2 * (layers + lm_head) * tokens / elapsed / 1e9,
            "layer_gflop": 2 * layers * tokens / 1e9, "lm_head_gflop": 2 * lm_head * tokens / 1e9}


def worker_memory() -> dict:
    """Where the RSS goes: after loading (weights, 4 GiB KV cache allocated), and after one
    520-token request; the KV cache's resident MiB at each point, and the peak."""
    from qwenserve import LLM, SamplingParams

    llm = LLM(model_path(), dtype="float32", max_model_len=1024)
    kv = list(llm.llm_engine.executor.worker.runner.caches.kv.values())

    def kv_resident() -> float:
        return sum(resident_bytes(c.data_ptr(), c.nbytes) for c in kv) / 2**20

    out = {"after_load_rss_mib": current_rss_mib(), "after_load_peak_rss_mib": peak_rss_mib(),
           "kv_allocated_mib": sum(c.nbytes for c in kv) / 2**20,
           "kv_resident_after_load_mib": kv_resident(),
           "weights_mib": llm.llm_engine.executor.weight_bytes() / 2**20}
    llm.generate([{"prompt_token_ids": list(range(100, 612))}],
                 SamplingParams(max_tokens=8, ignore_eos=True))
    return {**out, "after_request_rss_mib": current_rss_mib(), "peak_rss_mib": peak_rss_mib(),
            "kv_resident_after_request_mib": kv_resident()}


def current_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def worker_startup() -> dict:
    start = time.perf_counter()
    from qwenserve import LLM, SamplingParams

    llm = LLM(model_path(), dtype="float32", max_model_len=4096)
    ready = time.perf_counter() - start
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))
    return {"seconds_to_ready": ready, "engine_startup_s": llm.llm_engine.startup_s}


def worker_prefix() -> dict:
    """TTFT (max_tokens=1) of a 1,040-token prompt whose first 1,024 tokens are cached, vs the
    same request with prefix caching off (medians of 5)."""
    from qwenserve import LLM, SamplingParams

    rng = random.Random(2)
    prefix = [rng.randrange(VOCAB) for _ in range(1024)]
    result = {}
    for caching in (True, False):
        llm = LLM(model_path(), dtype="float32", max_model_len=2048,
                  enable_prefix_caching=caching)
        llm.generate([{"prompt_token_ids": prefix + [5] * 16}], SamplingParams(max_tokens=1))
        times = []
        for _ in range(5):
            suffix = [rng.randrange(VOCAB) for _ in range(16)]
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": prefix + suffix}], SamplingParams(max_tokens=1))
            times.append(time.perf_counter() - t)
        result["cached_s" if caching else "uncached_s"] = statistics.median(times)
        del llm
    return result


# ---- driver ------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hf-single", type=int, default=8, help="requests run one at a time")
    p.add_argument("--hf-static-batches", type=int, default=8, help="static batches of 8")
    p.add_argument("--shape", default="qwen2.5-0.5b", help="qwen2.5-0.5b or qwen3.5-0.8b")
    p.add_argument("--only", default="qwenserve,hf_single,hf_static,hf_single_same,"
                   "hf_static_same,matmul,decode,startup,prefix")
    args = p.parse_args()
    os.environ["QWENSERVE_BENCH_SHAPE"] = args.shape
    if args.worker:
        fn = {"qwenserve": lambda: worker_qwenserve(args.n),
              "hf": lambda: worker_hf(args.n, args.batch),
              "hf_same": lambda: worker_hf(args.n, args.batch, same_kernels=True),
              "matmul": worker_matmul,
              "decode": worker_decode, "startup": worker_startup, "prefix": worker_prefix,
              "memory": worker_memory}
        print(json.dumps(fn[args.worker]()))
        return
    model_path()
    jobs = {
        "qwenserve": ("--worker", "qwenserve", "--n", str(args.n)),
        "hf_single": ("--worker", "hf", "--n", str(args.hf_single), "--batch", "1"),
        "hf_static": ("--worker", "hf", "--n", str(8 * args.hf_static_batches), "--batch", "8"),
        "hf_single_same": ("--worker", "hf_same", "--n", str(args.hf_single), "--batch", "1"),
        "hf_static_same": ("--worker", "hf_same", "--n", str(8 * args.hf_static_batches),
                           "--batch", "8"),
        "matmul": ("--worker", "matmul"), "decode": ("--worker", "decode"),
        "startup": ("--worker", "startup"), "prefix": ("--worker", "prefix"),
        "memory": ("--worker", "memory"),
    }
    results = {}
    for name in args.only.split(","):
        results[name] = run_in_subprocess(SCRIPT, *jobs[name], "--shape", args.shape)
        print(name, json.dumps(results[name]), flush=True)
    print(json.dumps(results, indent=1))
    print(report(results))


def report(r: dict) -> str:
    """Markdown for docs/benchmarks.md from whichever parts ran (``--only``)."""
    def tps(x):
        return x["output_tokens"] / x["seconds"]

    rows = []
    if {"qwenserve", "hf_single", "hf_static"} <= r.keys():
        ours, single, static = tps(r["qwenserve"]), tps(r["hf_single"]), tps(r["hf_static"])
        q = r["qwenserve"]
        rows += [
            "| system | useful output tok/s | vs HF one-at-a-time | vs HF static batches "
            "| peak RSS |",
            "|---|---|---|---|---|",
            f"| qwenserve ({q['requests']} requests at once) | {ours:.1f} | "
            f"{ours / single:.1f}x | {ours / static:.1f}x | {q['peak_rss_mib']:.0f} MiB "
            f"(KV cache: {q['kv_resident_mib']:.0f} of {q['kv_allocated_mib']:.0f} MiB "
            "resident) |",
            f"| HF generate, one at a time ({r['hf_single']['requests']} requests) | "
            f"{single:.1f} | 1.0x | | {r['hf_single']['peak_rss_mib']:.0f} MiB |",
            f"| HF generate, static batches of 8 ({r['hf_static']['requests']} requests) | "
            f"{static:.1f} | | 1.0x | {r['hf_static']['peak_rss_mib']:.0f} MiB |",
        ]
        if {"hf_single_same", "hf_static_same"} <= r.keys():
            s1, s8 = tps(r["hf_single_same"]), tps(r["hf_static_same"])
            rows += [
                f"| HF, one at a time, engine's GEMM + allocator | {s1:.1f} | "
                f"{ours / s1:.1f}x (scheduler's share) | | "
                f"{r['hf_single_same']['peak_rss_mib']:.0f} MiB |",
                f"| HF, static batches of 8, engine's GEMM + allocator | {s8:.1f} | | "
                f"{ours / s8:.1f}x (scheduler's share) | "
                f"{r['hf_static_same']['peak_rss_mib']:.0f} MiB |",
            ]
        rows.append("")
    elif "qwenserve" in r:
        rows.append(f"qwenserve: {tps(r['qwenserve']):.1f} useful output tok/s, peak RSS "
                    f"{r['qwenserve']['peak_rss_mib']:.0f} MiB")
    if {"matmul", "decode"} <= r.keys():
        m, d = r["matmul"], r["decode"]
        # the GEMM time a decode step would take at the measured rates, each shape at its own
        ideal_s = d["layer_gflop"] / m["decode_shapes_64_gflops"] \
            + d["lm_head_gflop"] / m["lm_head_64_gflops"]
        rows.append(
            f"fp32 GEMM (engine's): {m['gemm_2048_gflops']:.1f} GFLOP/s (2048^3), "
            f"{m['decode_shapes_64_gflops']:.1f} GFLOP/s (layer shapes, 64 rows), "
            f"{m['lm_head_64_gflops']:.1f} GFLOP/s (LM head, 64 rows); "
            f"F.linear/MKL: {m['mkl_gemm_2048_gflops']:.1f} / "
            f"{m['mkl_decode_shapes_64_gflops']:.1f} / {m['mkl_lm_head_64_gflops']:.1f}; "
            f"batched decode (64 seqs): {d['tokens_per_s']:.1f} tok/s = {d['gflops']:.1f} "
            f"GFLOP/s; its GEMMs at the measured per-shape rates would take {ideal_s:.1f} s "
            f"of its {d['seconds']:.1f} s: {100 * ideal_s / d['seconds']:.0f}% of the GEMM "
            f"rate; {100 * d['gflops'] / m['gemm_2048_gflops']:.0f}% of the 2048^3 rate")
    if "memory" in r:
        mem = r["memory"]
        rows.append(f"RSS after load {mem['after_load_rss_mib']:.0f} MiB (KV resident "
                    f"{mem['kv_resident_after_load_mib']:.1f} of {mem['kv_allocated_mib']:.0f} "
                    f"MiB), after a 520-token request {mem['after_request_rss_mib']:.0f} MiB (KV "
                    f"{mem['kv_resident_after_request_mib']:.1f} MiB); peak "
                    f"{mem['peak_rss_mib']:.0f} MiB, {mem['after_load_peak_rss_mib']:.0f} of it "
                    "reached while loading")
    if "startup" in r:
        rows.append(f"start-up to ready: {r['startup']['seconds_to_ready']:.1f} s (engine "
                    f"{r['startup']['engine_startup_s']:.1f} s)")
    if "prefix" in r:
        p = r["prefix"]
        rows.append(f"TTFT with a cached 1,024-token prefix: {p['cached_s'] * 1000:.0f} ms vs "
                    f"{p['uncached_s'] * 1000:.0f} ms uncached "
                    f"({p['uncached_s'] / p['cached_s']:.1f}x)")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
