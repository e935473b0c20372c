"""`qwenserve plan MODEL`: memory plan per device, the smallest TP that fits, and the commands."""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

from qwenserve.tools.plan.compute import PlanInputs, RankPlan, plan_rank
from qwenserve.tools.plan.devices import (
    DEVICES,
    GIB,
    KV_DTYPE_BYTES,
    QUANT_WIDTHS,
    RUNTIME_OVERHEAD_BYTES,
    DevicePreset,
    parse_memory,
)

TP_CANDIDATES = (1, 2, 4, 8, 16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from qwenserve.config import human_readable_int

    parser.add_argument("model", help="model folder, config.json, or a hub id cached locally")
    parser.add_argument("--device", default="910b-64g", choices=sorted(DEVICES),
                        help="device preset (default 910b-64g)")
    parser.add_argument("--device-memory", help="memory per device instead of a preset, "
                        "e.g. 48GiB")
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=None,
                        help="tensor-parallel size (default: the smallest that fits)")
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "bfloat16", "float16", "float32"))
    parser.add_argument("--quantization", choices=[q for q in QUANT_WIDTHS if q])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_DTYPE_BYTES))
    parser.add_argument("--max-model-len", type=human_readable_int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=human_readable_int, default=2048)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None,
                        help="fixed KV budget per device (as the serve flag; CPU default 4 GiB)")
    parser.add_argument("--target-concurrency", type=float, default=1.0,
                        help="sequences of --max-model-len tokens that must fit at once")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    try:
        report = make_report(args)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["fits"] else 1


def make_report(args: argparse.Namespace) -> dict:
    from qwenserve.tools.plan.model import load_config

    hf_config, architecture, name = load_config(args.model)
    device = _device(args)
    dtype = _dtype(args.dtype, device)
    max_len = args.max_model_len or int(getattr(hf_config, "max_position_embeddings", 4096))
    block_size = args.block_size or (128 if device.kind == "npu" else 16)

    def inputs(tp: int) -> PlanInputs:
        return PlanInputs(hf_config, architecture, dtype, tp, max_len, args.max_num_seqs,
                          args.max_num_batched_tokens, block_size, args.quantization,
                          KV_DTYPE_BYTES[args.kv_cache_dtype])

    budget_for = _budget_function(args, device)
    tps = [args.tp] if args.tp else [tp for tp in TP_CANDIDATES if _tp_ok(hf_config, tp)]
    plans = [plan_rank(inputs(tp), budget_for) for tp in tps]
    chosen = _choose(plans, args.target_concurrency, max_len)
    report = {
        "model": name, "architecture": architecture, "device": device.name,
        "device_memory_bytes": device.memory_bytes, "dtype": dtype,
        "quantization": args.quantization, "max_model_len": max_len, "block_size": block_size,
        "target_concurrency": args.target_concurrency,
        "plans": [_plan_dict(p, max_len) for p in plans],
        "fits": chosen is not None,
        "chosen_tp": chosen.tp if chosen else None,
    }
    if chosen is not None:
        report["commands"] = _commands(args, chosen.tp, max_len, dtype, device)
    else:
        report["explanation"] = _explain(plans, args, max_len)
    return report


def _device(args: argparse.Namespace) -> DevicePreset:
    preset = DEVICES[args.device]
    if args.device_memory:
        return DevicePreset(f"{preset.name} ({args.device_memory})",
                            parse_memory(args.device_memory), preset.kind, preset.bf16)
    if preset.kind == "cpu":
        import psutil

        return DevicePreset(preset.name, psutil.virtual_memory().total, "cpu")
    return preset


def _dtype(requested: str, device: DevicePreset) -> str:
    if requested != "auto":
        return requested
    if device.kind == "cpu":
        from qwenserve.platforms.cpu import CpuPlatform

        return "bfloat16" if CpuPlatform().supports_native_bf16() else "float32"
    return "bfloat16"


def _budget_function(args: argparse.Namespace, device: DevicePreset):
    """KV budget per device, computed as the engine computes it."""
    if args.kv_cache_memory_bytes is not None:
        return lambda weights, activation: args.kv_cache_memory_bytes
    if device.kind == "cpu":
        from qwenserve.config import CacheConfig

        fixed = CacheConfig(16, True, None, 0.9).cpu_budget_bytes()
        return lambda weights, activation: fixed
    usable = int(device.memory_bytes * args.gpu_memory_utilization)
    overhead = RUNTIME_OVERHEAD_BYTES[device.kind]
    return lambda weights, activation: usable - weights - activation - overhead


def _tp_ok(hf_config: Any, tp: int) -> bool:
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    return heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def _choose(plans: list[RankPlan], target: float, max_len: int) -> RankPlan | None:
    for p in plans:
        if p.cache is not None and p.cache.max_concurrency(max_len) >= target:
            return p
    return None


def _plan_dict(p: RankPlan, max_len: int) -> dict:
    out = {"tp": p.tp, "weight_bytes_per_device": p.weight_bytes,
           "kv_bytes_per_token": p.kv_bytes_per_token,
           "state_bytes_per_sequence": p.state_bytes_per_seq,
           "activation_reserve_bytes": p.activation_bytes,
           "kv_cache_budget_bytes": p.budget_bytes,
           "largest_max_model_len": p.largest_max_model_len, "error": p.error}
    if p.cache is not None:
        out.update(num_blocks=p.cache.num_blocks, num_state_slots=p.cache.num_state_slots,
                   kv_token_capacity=p.cache.token_capacity,
                   max_concurrency=round(p.cache.max_concurrency(max_len), 2))
    return out


def _commands(args: argparse.Namespace, tp: int, max_len: int, dtype: str,
              device: DevicePreset) -> dict:
    flags = ["--tensor-parallel-size", str(tp), "--max-model-len", str(max_len),
             "--dtype", dtype, "--max-num-seqs", str(args.max_num_seqs)]
    if args.kv_cache_memory_bytes is not None:
        flags += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    elif device.kind != "cpu":
        flags += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    ours, theirs = list(flags), list(flags)
    if args.quantization:
        ours += ["--quantization", args.quantization]
        theirs += ["--quantization",
                   "ascend" if device.kind == "npu" and args.quantization in ("w8a8", "int8")
                   else "compressed-tensors" if args.quantization in ("w8a8", "int8")
                   else args.quantization]
    if args.kv_cache_dtype != "auto":
        theirs += ["--kv-cache-dtype", args.kv_cache_dtype]
    model = shlex.quote(args.model)
    return {"qwenserve": f"qwenserve serve {model} " + shlex.join(ours),
            "vllm": f"vllm serve {model} " + shlex.join(theirs)}


def _explain(plans: list[RankPlan], args: argparse.Namespace, max_len: int) -> str:
    if not plans:
        return "no tensor-parallel size divides the model's attention heads"
    best = max(plans, key=lambda p: p.largest_max_model_len)
    if best.cache is not None:
        return (f"at most {best.cache.max_concurrency(max_len):.2f} sequences of {max_len} "
                f"tokens fit (TP={best.tp}), below the target {args.target_concurrency}: use "
                "more devices, --quantization w8a8, or a lower --max-model-len")
    if best.largest_max_model_len > 0:
        return (f"one sequence of {max_len} tokens does not fit; the longest that fits is "
                f"{best.largest_max_model_len} tokens at TP={best.tp}: lower --max-model-len "
                f"to {best.largest_max_model_len}, quantize, or use more devices")
    return (f"the weights alone need {best.weight_bytes / GIB:.1f} GiB per device at "
            f"TP={best.tp}: use more devices (--tp), --quantization w8a8, or larger devices")


def format_report(report: dict) -> str:
    from qwenserve.tools.plan.render import render

    return render(report)
