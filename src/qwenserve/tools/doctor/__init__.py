"""``qwenserve doctor [--model DIR]``: is this machine (and this model folder) ready to serve?

Every check returns PASS/WARN/FAIL (SKIP when it does not apply) with a one-line reason and the
fix. The exit code is 0 when nothing failed. Nothing here imports torch: versions come from package
metadata and device probes run in a child interpreter, so a broken torch_npu cannot take doctor
down with it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from qwenserve.tools.doctor import checks_ascend, checks_devices, checks_model, checks_network
from qwenserve.tools.doctor import checks_system as system
from qwenserve.tools.doctor.ascend import DEFAULT_ASCEND_ROOT
from qwenserve.tools.doctor.context import PLATFORMS, DoctorContext, detect_platform, read_npu_smi
from qwenserve.tools.doctor.result import Check, Status, exit_code, render_json, render_text

CheckFn = Callable[[DoctorContext], Check]

_COMMON: tuple[CheckFn, ...] = (system.check_python, system.check_torch)
_ASCEND: tuple[CheckFn, ...] = (
    checks_ascend.check_torch_npu,
    checks_ascend.check_driver,
    checks_ascend.check_firmware,
    checks_ascend.check_cann,
    checks_ascend.check_cann_env,
    checks_ascend.check_driver_libs,
    checks_devices.check_torch_npu_import,
)
_DEVICES: tuple[CheckFn, ...] = (
    checks_devices.check_devices,
    checks_devices.check_busy,
    checks_network.check_collective_env,
    system.check_disk,
    system.check_memory,
    system.check_port,
)
_MODEL: tuple[CheckFn, ...] = (
    checks_model.check_model_permissions,
    checks_model.check_model_config,
    checks_model.check_model_quantization,
    checks_model.check_model_index,
    checks_model.check_model_shards,
    checks_model.check_model_tokenizer,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="DIR",
        help="also check this local model folder (config, shards, tokenizer)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON report")
    parser.add_argument(
        "--platform",
        choices=PLATFORMS,
        default="auto",
        help="which accelerator to check for (default: detect)",
    )
    parser.add_argument(
        "--ascend-root",
        type=Path,
        default=Path(DEFAULT_ASCEND_ROOT),
        help=f"where CANN and the driver are installed (default {DEFAULT_ASCEND_ROOT})",
    )
    parser.add_argument("--host", default="0.0.0.0", help="the address serve will bind")
    parser.add_argument("--port", type=int, default=8000, help="the port serve will bind")
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, help="devices the run will use"
    )
    parser.add_argument(
        "--multi-node",
        action="store_true",
        help="the run spans hosts: require HCCL_IF_IP / NIC settings",
    )


def build_context(args: argparse.Namespace) -> DoctorContext:
    root = Path(args.ascend_root)
    platform = detect_platform(root) if args.platform == "auto" else args.platform
    npu_smi, npu_smi_error = read_npu_smi() if platform == "npu" else (None, None)
    return DoctorContext(
        platform=platform,
        ascend_root=root,
        model_dir=args.model,
        host=args.host,
        port=args.port,
        tensor_parallel_size=args.tensor_parallel_size,
        multi_node=args.multi_node,
        npu_smi=npu_smi,
        npu_smi_error=npu_smi_error,
    )


def _safe(check: CheckFn, ctx: DoctorContext) -> Check:
    """A crashing check is a finding, not a reason to lose the other checks' results."""
    try:
        return check(ctx)
    except Exception as e:  # noqa: BLE001 - report and continue
        name = check.__name__.removeprefix("check_")
        return Check(
            name, Status.FAIL, f"the check crashed: {e!r}", "report this as a qwenserve bug"
        )


def run_checks(ctx: DoctorContext) -> list[Check]:
    plan = list(_COMMON) + (list(_ASCEND) if ctx.platform == "npu" else []) + list(_DEVICES)
    if ctx.model_dir is not None:
        plan += list(_MODEL)
    return [_safe(check, ctx) for check in plan]


def run(args: argparse.Namespace) -> int:
    ctx = build_context(args)
    checks = run_checks(ctx)
    print(render_json(checks, ctx.platform) if args.json else render_text(checks, ctx.platform))
    return exit_code(checks)
