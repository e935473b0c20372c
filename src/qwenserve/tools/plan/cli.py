"""`qwenserve plan MODEL`: memory plan per device, the smallest TP that fits, and the commands."""

from __future__ import annotations

import argparse
import json
from typing import Any

from qwenserve.config import resolve_ssm_cache_dtype
from qwenserve.core.cache.plan import accelerator_kv_budget
from qwenserve.tools.plan.commands import DEFAULT_BATCHED_TOKENS, CommandInputs, build_commands
from qwenserve.tools.plan.compute import PlanInputs, RankPlan, plan_rank
from qwenserve.tools.plan.devices import (
    DEVICES,
    GIB,
    KV_DTYPE_BYTES,
    QUANT_WIDTHS,
    RUNTIME_OVERHEAD_BYTES,
    SSM_DTYPE_BYTES,
    DevicePreset,
    parse_memory,
)

TP_CANDIDATES = (1, 2, 4, 8, 16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from qwenserve.engine.arg_utils import human_readable_int, json_object

    parser.add_argument("model", help="model folder, config.json, or a hub id cached locally")
    parser.add_argument("--device", default="910b-64g", choices=sorted(DEVICES),
                        help="device preset (default 910b-64g)")
    parser.add_argument("--device-memory", help="memory per device instead of a preset, "
                        "e.g. 48GiB")
    parser.add_argument("--tp", "--tensor-parallel-size", "-tp", dest="tp", type=int, default=None,
                        help="tensor-parallel size (default: the smallest that fits)")
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "bfloat16", "float16", "half", "float32", "float"))
    parser.add_argument("--quantization", choices=[q for q in QUANT_WIDTHS if q])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_DTYPE_BYTES))
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="Gated DeltaNet state dtype, as serve's flag (auto: the checkpoint's "
                        "mamba_ssm_dtype, else float32)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="plan MoE experts whole per device (serve's flag); the busiest "
                        "device holds ceil(experts / TP)")
    parser.add_argument("--hf-overrides", type=json_object, default=None,
                        help="JSON merged into the config first, as serve's flag (e.g. YaRN)")
    parser.add_argument("--max-model-len", type=human_readable_int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None,
                        help="one step's token budget (default: serve's, 1024 on CPU, else 2048)")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None,
                        help="fixed KV budget per device (as the serve flag; CPU default 4 GiB)")
    parser.add_argument("--target-concurrency", type=float, default=1.0,
                        help="sequences of --max-model-len tokens that must fit at once")
    parser.add_argument("--speculative-config", default=None,
                        help="serve's flag; methods mtp and eagle3 add the head (its weights, "
                        "sharded per rank like the target's, and one paged KV layer) to the "
                        "plan")
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
    from qwenserve.models.model_config import resolve_max_model_len
    from qwenserve.spec_decode.config import (
        EAGLE3,
        MTP,
        mtp_num_layers,
        parse_speculative_config,
    )
    from qwenserve.tools.plan.model import load_config
    from qwenserve.tools.plan.quant import checkpoint_quantization, qwenserve_problem

    model = load_config(args.model, args.hf_overrides)
    hf_config = model.hf_config
    device = _device(args)
    args.max_num_batched_tokens = args.max_num_batched_tokens or _served_batched_tokens(device)
    dtype = _dtype(args.dtype, model.ckpt_dtype, device)
    max_len = resolve_max_model_len(args.max_model_len, hf_config)  # the engine's own checks
    block_size = args.block_size or (128 if device.kind == "npu" else 16)
    checkpoint = checkpoint_quantization(hf_config, model.folder)
    quant = args.quantization or checkpoint.width

    speculative = parse_speculative_config(getattr(args, "speculative_config", None),
                                           mtp_num_layers(hf_config))
    mtp = speculative is not None and speculative.method == MTP
    eagle3 = None
    if speculative is not None and speculative.method == EAGLE3:
        from qwenserve.models.eagle3 import load_eagle3_config

        eagle3 = load_eagle3_config(speculative.model, hf_config).hf_config

    ssm_dtype = resolve_ssm_cache_dtype(args.mamba_ssm_cache_dtype, hf_config)

    def inputs(tp: int) -> PlanInputs:
        return PlanInputs(hf_config, model.architecture, dtype, tp, max_len, args.max_num_seqs,
                          args.max_num_batched_tokens, block_size, quant,
                          KV_DTYPE_BYTES[args.kv_cache_dtype],
                          SSM_DTYPE_BYTES[ssm_dtype],
                          args.enable_expert_parallel, mtp, eagle3)

    plans = _plans(args, hf_config, inputs, _budget_function(args, device))
    chosen = _choose(plans, args.target_concurrency, max_len)
    report = {
        "model": model.name, "architecture": model.architecture, "device": device.name,
        "device_memory_bytes": device.memory_bytes, "dtype": dtype, "quantization": quant,
        "quantization_from_checkpoint": checkpoint.from_checkpoint and not args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype, "max_model_len": max_len,
        "mamba_ssm_cache_dtype": ssm_dtype,
        "enable_expert_parallel": args.enable_expert_parallel,
        "model_max_model_len": int(getattr(hf_config, "max_position_embeddings", 0) or 4096),
        "block_size": block_size, "target_concurrency": args.target_concurrency,
        "plans": [_plan_dict(p, max_len) for p in plans],
        "fits": chosen is not None, "chosen_tp": chosen.tp if chosen else None, "notes": [],
    }
    if chosen is not None:
        problem = qwenserve_problem(hf_config, args.quantization, checkpoint)
        commands = build_commands(CommandInputs(args, chosen.tp, max_len, dtype, device.kind,
                                                quant, checkpoint, problem))
        report["commands"] = {"qwenserve": commands.qwenserve, "vllm": commands.vllm}
        report["notes"] = commands.notes
    else:
        report["explanation"] = _explain(plans, args, max_len)
    return report


def _plans(args: argparse.Namespace, hf_config: Any, inputs: Any, budget_for: Any) -> list:
    """One plan per TP size: ``--tp``, else every size whose model can be built (a size that
    does not divide some dimension, e.g. DeltaNet heads or expert widths, is left out)."""
    if args.tp:
        return [plan_rank(inputs(args.tp), budget_for)]
    plans, errors = [], []
    for tp in (tp for tp in TP_CANDIDATES if _tp_ok(hf_config, tp)):
        try:
            plans.append(plan_rank(inputs(tp), budget_for))
        except ValueError as e:
            errors.append(e)
    if not plans and errors:
        raise errors[0]  # not a divisibility problem: the model itself cannot be built
    return plans


def _device(args: argparse.Namespace) -> DevicePreset:
    preset = DEVICES[args.device]
    if args.device_memory:
        memory = parse_memory(args.device_memory)
        kind = "npu" if preset.kind == "cpu" else preset.kind
        return DevicePreset(f"{args.device_memory} {kind} device ({memory / GIB:.2f} GiB)",
                            memory, kind, preset.bf16)
    if preset.kind == "cpu":
        import psutil

        return DevicePreset(preset.name, psutil.virtual_memory().total, "cpu")
    return preset


def _served_batched_tokens(device: DevicePreset) -> int:
    """`serve`'s default step size on this device (the engine's platform default)."""
    if device.kind == "cpu":
        from qwenserve.platforms.cpu import CpuPlatform

        return CpuPlatform.default_served_batched_tokens
    return DEFAULT_BATCHED_TOKENS


class _PresetPlatform:
    """What the engine's dtype rule asks of a platform, answered for a preset."""

    def __init__(self, device: DevicePreset) -> None:
        self.is_accelerator, self.bf16 = device.kind != "cpu", device.bf16

    def supports_native_bf16(self) -> bool:
        return self.bf16


def _dtype(requested: str, ckpt_dtype: str, device: DevicePreset) -> str:
    """``--dtype auto`` resolved as the engine resolves it (bfloat16 on accelerators unless the
    checkpoint is float16; on CPU bfloat16 only where the CPU computes it natively)."""
    from qwenserve.models.model_config import resolve_dtype

    if device.kind == "cpu":
        from qwenserve.platforms.cpu import CpuPlatform

        return resolve_dtype(requested, ckpt_dtype, CpuPlatform())
    return resolve_dtype(requested, ckpt_dtype, _PresetPlatform(device))


def _budget_function(args: argparse.Namespace, device: DevicePreset):
    """KV budget per device, computed as the engine computes it."""
    if args.kv_cache_memory_bytes is not None:
        return lambda weights, activation: args.kv_cache_memory_bytes
    if device.kind == "cpu":
        from qwenserve.config import CacheConfig

        fixed = CacheConfig(16, True, None, 0.9).cpu_budget_bytes()
        return lambda weights, activation: fixed
    overhead = RUNTIME_OVERHEAD_BYTES[device.kind]
    return lambda weights, activation: accelerator_kv_budget(
        device.memory_bytes, args.gpu_memory_utilization, weights, activation, overhead)


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
           "vision_weight_bytes": p.details.get("vision", 0),
           "speculative_head_weight_bytes": p.details.get("speculative_head", 0),
           "kv_cache_budget_bytes": p.budget_bytes,
           "largest_max_model_len": p.largest_max_model_len, "error": p.error}
    if p.cache is not None:
        out.update(num_blocks=p.cache.num_blocks, num_state_slots=p.cache.num_state_slots,
                   kv_token_capacity=p.cache.token_capacity,
                   max_concurrency=round(p.cache.max_concurrency(max_len), 2))
    return out


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
