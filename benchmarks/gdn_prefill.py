"""Prefill through Qwen3.5 Gated DeltaNet layers: chunked kernel vs token-by-token recurrence.

Qwen3.5-0.8B shapes (hidden 1024, 16 key / 16 value heads of dim 128, conv kernel 4), random
weights, fp32, the CPU platform's recurrent backend (``fused``: the C++ chunked prefill where a
compiler is; ``--backend torch_ref``: the pure-PyTorch reference); the token-by-token side is
always the reference recurrence. Times the whole layer (projections, conv, gating,
delta rule, gated norm, out_proj) and the delta-rule core alone, alternating the two variants;
prints markdown table rows (median of the repeats, and the min: steadier on a shared machine).

    python benchmarks/gdn_prefill.py [--tokens 2048] [--layers 1] [--repeats 3] [--threads N]
                                     [--chunk-size 32] [--hf] [--backend fused]
                                     [--decode-batch 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from qwenserve.layers.recurrent import (
    RecurrentBackend,
    build_gdn_metadata,
    causal_conv1d_varlen,
    gdn_gating,
    get_recurrent_backend,
    rms_norm_gated,
)
from qwenserve.layers.recurrent.delta_rule import recurrent_gated_delta_rule
from qwenserve.layers.recurrent.fused import native_ops
from qwenserve.platforms.cpu import CpuPlatform

HIDDEN, HK, HV, DK, DV, KERNEL = 1024, 16, 16, 128, 128, 4
CONV_DIM = 2 * HK * DK + HV * DV


class GDNLayer(nn.Module):
    """Just enough of a Qwen3.5 Gated DeltaNet layer to time it (one request, slot 0)."""

    def __init__(self, backend: RecurrentBackend, chunk_size: int) -> None:
        super().__init__()
        self.backend, self.chunk_size = backend, chunk_size
        self.in_proj_qkv = nn.Linear(HIDDEN, CONV_DIM, bias=False)
        self.in_proj_z = nn.Linear(HIDDEN, HV * DV, bias=False)
        self.in_proj_ba = nn.Linear(HIDDEN, 2 * HV, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(CONV_DIM, KERNEL) * 0.3)  # [conv_dim, K]
        self.A_log = nn.Parameter(torch.empty(HV).uniform_(0.01, 16).log())
        self.dt_bias = nn.Parameter(torch.ones(HV))
        self.norm_weight = nn.Parameter(torch.ones(DV))
        self.out_proj = nn.Linear(HV * DV, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, chunked: bool) -> torch.Tensor:
        num_tokens = x.shape[0]
        meta = build_gdn_metadata([0, num_tokens], [0], [False], chunk_size=self.chunk_size)
        conv_state = torch.zeros(1, KERNEL - 1, CONV_DIM)  # [num_slots, K-1, conv_dim]
        ssm_state = torch.zeros(1, HV, DK, DV)  # [num_slots, Hv, Dk, Dv]
        mixed = self.in_proj_qkv(x)  # [T, conv_dim]
        if chunked:
            mixed = self.backend.causal_conv1d(mixed, self.conv_weight, None, conv_state, meta)
        else:
            mixed = causal_conv1d_varlen(
                mixed, self.conv_weight, None, conv_state, meta.query_start_loc,
                meta.state_slots, meta.has_initial_state,
            )  # fmt: skip
        q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
        q, k, v = q.view(-1, HK, DK), k.view(-1, HK, DK), v.view(-1, HV, DV)
        b, a = self.in_proj_ba(x).chunk(2, dim=-1)  # [T, Hv] each
        g, beta = gdn_gating(a, b, self.A_log, self.dt_bias)
        if chunked:
            o = self.backend.gated_delta_rule(q, k, v, g, beta, ssm_state, meta)  # [T, Hv, Dv]
        else:
            o, _ = recurrent_gated_delta_rule(q, k, v, g, beta)
        z = self.in_proj_z(x).view(num_tokens, HV, DV)
        o = rms_norm_gated(o, z, self.norm_weight)
        return self.out_proj(o.reshape(num_tokens, HV * DV))


def time_pair(
    fns: tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]], repeats: int
) -> tuple[list[list[float]], list[list[float]], list[torch.Tensor]]:
    """Wall and CPU times of both functions, alternated so that load from other processes hits
    both. CPU time (this process's, all threads) is the steadier figure on a loaded machine: it
    leaves out the time the threads wait for a core."""
    outs = [fn() for fn in fns]  # warm-up
    times: list[list[float]] = [[], []]
    cpu: list[list[float]] = [[], []]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start, start_cpu = time.perf_counter(), time.process_time()
            outs[i] = fn()
            times[i].append(time.perf_counter() - start)
            cpu[i].append(time.process_time() - start_cpu)
    return times, cpu, outs


def core_inputs(num_tokens: int) -> tuple[torch.Tensor, ...]:
    q = torch.randn(num_tokens, HK, DK)  # [T, Hk, Dk]
    k = torch.randn(num_tokens, HK, DK)  # [T, Hk, Dk]
    v = torch.randn(num_tokens, HV, DV)  # [T, Hv, Dv]
    g = torch.nn.functional.logsigmoid(torch.randn(num_tokens, HV))  # [T, Hv] log decay
    beta = torch.rand(num_tokens, HV)  # [T, Hv]
    return q, k, v, g, beta


def hf_kernels() -> tuple[Callable, Callable] | None:
    """HF's torch fallbacks (transformers >= 5.2), for reference; None when unavailable."""
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    except ImportError:
        return None
    return hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule


def build_cases(args: argparse.Namespace) -> dict[str, tuple[Callable, Callable]]:
    backend = get_recurrent_backend(args.backend)
    if hasattr(backend, "native_chunk_size"):  # fused: --chunk-size is its C++ kernel's
        backend.native_chunk_size = args.chunk_size
    layers = [GDNLayer(backend, args.chunk_size) for _ in range(args.layers)]
    x = torch.randn(args.tokens, HIDDEN)  # [T, hidden]

    def run_layers(chunked: bool) -> torch.Tensor:
        h = x
        for layer in layers:
            h = layer(h, chunked)
        return h

    q, k, v, g, beta = core_inputs(args.tokens)
    meta = build_gdn_metadata([0, args.tokens], [0], [False], chunk_size=args.chunk_size)
    pool = torch.zeros(1, HV, DK, DV)  # [num_slots, Hv, Dk, Dv]
    cases = {
        f"{args.layers} GDN layer(s)": (lambda: run_layers(True), lambda: run_layers(False)),
        "delta-rule core": (
            lambda: backend.gated_delta_rule(q, k, v, g, beta, pool, meta),
            lambda: recurrent_gated_delta_rule(q, k, v, g, beta)[0],
        ),
    }
    if args.hf and (kernels := hf_kernels()):
        batch = (q[None], k[None], v[None], g[None], beta[None])
        kw = {"use_qk_l2norm_in_kernel": True}
        cases["HF torch fallbacks, core"] = (
            lambda: kernels[0](*batch, **kw)[0][0],
            lambda: kernels[1](*batch, **kw)[0][0],
        )
    return cases


def decode_case(backend: RecurrentBackend, batch: int) -> Callable[[], torch.Tensor]:
    """One decode step of ``batch`` sequences through a GDN layer's kernels (conv, gating, delta
    rule, gated norm): the state-pool traffic the projections' GEMMs sit beside."""
    conv_state = torch.randn(batch, KERNEL - 1, CONV_DIM)  # [slots, K-1, conv_dim]
    pool = torch.randn(batch, HV, DK, DV) * 0.1  # [slots, Hv, Dk, Dv]
    x = torch.randn(batch, CONV_DIM)
    weight = torch.randn(CONV_DIM, KERNEL) * 0.3
    a, b, z = torch.randn(batch, HV), torch.randn(batch, HV), torch.randn(batch, HV, DV)
    a_log, dt_bias, norm_weight = torch.rand(HV), torch.rand(HV), torch.ones(DV)
    slots = list(range(batch))

    def step() -> torch.Tensor:
        meta = backend.build_metadata(list(range(batch + 1)), slots, [True] * batch, "cpu")
        mixed = backend.causal_conv1d(x, weight, None, conv_state, meta)
        q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
        g, beta = gdn_gating(a, b, a_log, dt_bias)
        o = backend.gated_delta_rule(q.reshape(batch, HK, DK), k.reshape(batch, HK, DK),
                                     v.reshape(batch, HV, DV), g, beta, pool, meta)
        return rms_norm_gated(o, z, norm_weight)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default=CpuPlatform.default_recurrent_backend,
                        help="recurrent backend of the chunked side (default: the CPU platform's)")
    parser.add_argument("--chunk-size", type=int, default=0,
                        help="0: the backend's (fused: its C++ kernel's, also the reference's)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--hf", action="store_true", help="also time HF's torch fallbacks")
    parser.add_argument("--decode-batch", type=int, default=64,
                        help="also time a decode step of this batch, backend vs torch_ref (0: no)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    default = get_recurrent_backend(args.backend)
    ops = native_ops() if hasattr(default, "native_chunk_size") else None
    args.chunk_size = args.chunk_size or (ops.preferred_chunk_size if ops else default.chunk_size)
    torch.manual_seed(0)
    cases = build_cases(args)
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, fp32, CPU, backend {args.backend}, "
          f"chunk size {args.chunk_size}")
    print(
        "| what (Qwen3.5-0.8B shapes) | tokens | chunked ms | recurrent ms | speed-up "
        "| min chunked / recurrent ms | CPU ms chunked / recurrent | CPU-time speed-up "
        "| max diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for what, fns in cases.items():
            (t_chunk, t_rec), (c_chunk, c_rec), (o_chunk, o_rec) = time_pair(fns, args.repeats)
            med_c, med_r = statistics.median(t_chunk) * 1e3, statistics.median(t_rec) * 1e3
            cpu_c, cpu_r = statistics.median(c_chunk) * 1e3, statistics.median(c_rec) * 1e3
            diff = (o_chunk.float() - o_rec.float()).abs().max().item()
            print(
                f"| {what} | {args.tokens} | {med_c:.1f} | {med_r:.1f} | {med_r / med_c:.1f}x "
                f"| {min(t_chunk) * 1e3:.1f} / {min(t_rec) * 1e3:.1f} | {cpu_c:.1f} / {cpu_r:.1f} "
                f"| {cpu_r / cpu_c:.1f}x | {diff:.1e} |"
            )
        if args.decode_batch:
            fns = (decode_case(get_recurrent_backend(args.backend), args.decode_batch),
                   decode_case(get_recurrent_backend("torch_ref"), args.decode_batch))
            (t_new, t_ref), (c_new, c_ref), _ = time_pair(fns, args.repeats)
            print(f"\n| GDN decode step, batch {args.decode_batch} (conv, gating, delta rule, gated "
                  f"norm) | {args.backend} ms | torch_ref ms | speed-up | CPU ms {args.backend} / "
                  "torch_ref | CPU-time speed-up |\n|---|---|---|---|---|---|")
            med_n, med_r = statistics.median(t_new) * 1e3, statistics.median(t_ref) * 1e3
            cpu_n, cpu_r = statistics.median(c_new) * 1e3, statistics.median(c_ref) * 1e3
            print(f"| one layer | {med_n:.1f} | {med_r:.1f} | {med_r / med_n:.1f}x "
                  f"| {cpu_n:.1f} / {cpu_r:.1f} | {cpu_r / cpu_n:.1f}x |")


if __name__ == "__main__":
    main()
