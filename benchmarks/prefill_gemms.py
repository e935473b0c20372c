"""oneDNN's prefill GEMMs inside the engine's steps against the same calls in a simulated step.

At 2,048-token prefill steps vLLM's CPU backend ran ~1.3x faster than qwenserve with the same
oneDNN kernels: qwenserve's calls took about twice their time outside the engine
(docs/benchmarks.md, "a prefill gap at equal step sizes"). This runs both sides in one process:

- ``engine``: the offline workload's prefill (``--prompts`` x ``--prompt-len`` random tokens, one
  output token) on the random-weight Qwen2.5-0.5B shape, timing every packed oneDNN call;
- ``sim``: the same layers outside the engine on packed random weights of the same shapes, with
  the engine's native kernels between the GEMMs (RMSNorm with residual, rotary, K/V written into
  never-touched cache memory, prefill attention per prompt, SiLU, the MLP's row chunks) and each
  output feeding the next call.

It prints each GEMM shape's median milliseconds on both sides and the step times; alternating
rounds. A quiet machine is needed: the host's phases move single calls 2x.

    PYTHONPATH=src python benchmarks/prefill_gemms.py [--rounds 2] [--prompts 64] [--prompt-len 256]
        [--per-round] [--enable-prefix-caching]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN25_05B, shaped_model  # noqa: E402

Timings = dict[tuple[int, int, int], list[float]]


def timed_packed_linear(timings: Timings):
    """Wrap the engine's packed oneDNN call so each call's wall time lands in ``timings``."""
    import qwenserve.platforms.cpu_packed_gemm as packed_gemm

    inner = packed_gemm._packed_linear

    def timed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        start = time.perf_counter()
        out = inner(x, packed, bias)
        timings[(x.shape[0], x.shape[1], out.shape[-1])].append(time.perf_counter() - start)
        return out

    packed_gemm._packed_linear = timed


def engine_prefill(llm, prompts: list[list[int]], timings: Timings) -> float:
    from qwenserve import SamplingParams

    timings.clear()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start


class SimulatedStep:
    """The engine's prefill layers on packed random weights of the Qwen2.5-0.5B shape."""

    def __init__(self, tokens: int, prompt_len: int, mlp_chunk: int) -> None:
        from qwenserve.native.attention import prefill_attention
        from qwenserve.native.elementwise import elementwise

        self.ew, self.attention = elementwise(), prefill_attention()
        if self.ew is None or self.attention is None:
            raise SystemExit("the simulation needs the native elementwise and AMX prefill "
                             "attention kernels (a compiler and an AMX CPU)")
        s = QWEN25_05B
        self.hidden, self.layers = s["hidden_size"], s["num_hidden_layers"]
        self.heads, self.kv_heads = s["num_attention_heads"], s["num_key_value_heads"]
        self.head_dim = self.hidden // self.heads
        inter, kv_width = s["intermediate_size"], self.kv_heads * self.head_dim
        self.tokens, self.prompt_len, self.mlp_chunk = tokens, prompt_len, mlp_chunk

        def pack(n: int, k: int) -> torch.Tensor:
            w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
            return torch.ops.mkldnn._reorder_linear_weight(w, 64)

        self.weights = [dict(qkv=pack(self.hidden + 2 * kv_width, self.hidden),
                             o=pack(self.hidden, self.hidden), gate_up=pack(2 * inter, self.hidden),
                             down=pack(self.hidden, inter)) for _ in range(self.layers)]
        self.norm_weight = torch.ones(self.hidden, dtype=torch.bfloat16)
        self.positions = torch.arange(prompt_len).repeat(tokens // prompt_len)
        self.cos = torch.randn(s["max_position_embeddings"], self.head_dim)
        self.sin = torch.randn(s["max_position_embeddings"], self.head_dim)
        slots = 64 * tokens  # room for 64 steps of first-touch K/V writes
        self.kv = [torch.empty(2, slots, self.kv_heads, self.head_dim, dtype=torch.bfloat16)
                   for _ in range(self.layers)]
        self.cursor = 0

    def linear(self, x: torch.Tensor, packed: torch.Tensor, timings: Timings) -> torch.Tensor:
        start = time.perf_counter()
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        timings[(x.shape[0], x.shape[1], out.shape[-1])].append(time.perf_counter() - start)
        return out

    def step(self, timings: Timings) -> float:
        start = time.perf_counter()
        t, d, hq, hkv = self.tokens, self.head_dim, self.heads, self.kv_heads
        h, residual = torch.randn(t, self.hidden, dtype=torch.bfloat16), None
        slots = torch.arange(self.cursor, self.cursor + t) % self.kv[0].shape[1]
        for layer, w in enumerate(self.weights):
            x, residual = self.ew.rms_norm(h, residual, self.norm_weight, 1e-6, False)
            qkv = self.linear(x, w["qkv"], timings)
            q = qkv[:, : hq * d].reshape(t, hq, d).contiguous()
            k = qkv[:, hq * d: (hq + hkv) * d].reshape(t, hkv, d).contiguous()
            v = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d).contiguous()
            self.ew.rotary(self.positions, q, k, self.cos, self.sin, d)
            self.kv[layer][0].index_copy_(0, slots, k)
            self.kv[layer][1].index_copy_(0, slots, v)
            attended = torch.empty(t, hq * d, dtype=torch.bfloat16)
            for p in range(0, t, self.prompt_len):
                rows = slice(p, p + self.prompt_len)
                attended[rows] = self.attention(q[rows], k[rows], v[rows],
                                                d ** -0.5).reshape(self.prompt_len, -1)
            h = self.linear(attended, w["o"], timings)
            x, residual = self.ew.rms_norm(h, residual, self.norm_weight, 1e-6, False)
            h = torch.empty(t, self.hidden, dtype=torch.bfloat16)
            for c in range(0, t, self.mlp_chunk):
                gate_up = self.linear(x[c: c + self.mlp_chunk], w["gate_up"], timings)
                h[c: c + self.mlp_chunk] = self.linear(self.ew.silu_and_mul(gate_up), w["down"],
                                                       timings)
        self.cursor += t
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--per-round", action="store_true",
                   help="also print each round's engine prefill time and GEMM medians")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="the engine's default (off here: the prompts share nothing)")
    args = p.parse_args()
    from qwenserve import LLM
    from qwenserve.platforms.cpu import CpuPlatform

    engine_timings: Timings = collections.defaultdict(list)
    sim_timings: Timings = collections.defaultdict(list)
    timed_packed_linear(engine_timings)
    llm = LLM(shaped_model("qwen2.5-0.5b"), dtype="bfloat16", max_model_len=1024,
              max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=args.enable_prefix_caching)
    sim = SimulatedStep(args.max_num_batched_tokens, args.prompt_len, CpuPlatform.mlp_row_chunk)
    steps = args.prompts * args.prompt_len / args.max_num_batched_tokens
    gen = torch.Generator().manual_seed(0)
    engine_s, sim_s = [], []
    for r in range(args.rounds + 1):  # round 0 warms both up
        prompts = torch.randint(100, 50_000, (args.prompts, args.prompt_len), generator=gen)
        run_engine = engine_prefill(llm, prompts.tolist(), engine_timings)
        if args.per_round:
            medians = {shape: round(1e3 * statistics.median(t), 2)
                       for shape, t in engine_timings.items() if len(t) > 1}
            print(f"round {r}: engine prefill {run_engine:.2f} s, GEMM medians (ms) {medians}")
        sim_timings.clear()
        run_sim = [sim.step(sim_timings) for _ in range(int(steps))]
        if r:
            engine_s.append(run_engine / steps)
            sim_s.append(statistics.median(run_sim))
    print(f"prefill step of {args.max_num_batched_tokens} tokens: engine "
          f"{1e3 * statistics.median(engine_s):.0f} ms, simulation "
          f"{1e3 * statistics.median(sim_s):.0f} ms (medians of {args.rounds} rounds; the "
          "engine's includes embedding, LM head and scheduling)")
    print("| GEMM rows x K -> N | calls a round (engine) | engine median ms "
          "| simulation median ms |\n|---|---|---|---|")
    for shape in sorted(engine_timings, key=lambda s: -sum(engine_timings[s])):
        if shape not in sim_timings:
            continue
        rows, k, n = shape
        print(f"| {rows} x {k} -> {n} | {len(engine_timings[shape])} | "
              f"{1e3 * statistics.median(engine_timings[shape]):.2f} | "
              f"{1e3 * statistics.median(sim_timings[shape]):.2f} |")


if __name__ == "__main__":
    main()
