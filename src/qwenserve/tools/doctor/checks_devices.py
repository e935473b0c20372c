"""Are the accelerators there, healthy, ours alone, and can torch see them?"""

from __future__ import annotations

import os
import shutil
import subprocess

from qwenserve import envs
from qwenserve.tools.doctor.context import (
    DoctorContext,
    installed_version,
    last_line,
    run_python_probe,
)
from qwenserve.tools.doctor.npu_smi import NpuChip
from qwenserve.tools.doctor.result import Check, fail, passed, skip, warn

_BUSY_HBM_FRACTION = 0.15  # an idle 910B holds ~3.4 of 64 GB for the driver
_DEVICE_MOUNTS = (
    "--device /dev/davinciN --device /dev/davinci_manager --device /dev/devmm_svm "
    "--device /dev/hisi_hdc"
)


def visible_ids(num_devices: int, env_name: str) -> tuple[list[int], list[str]]:
    """(visible logical ids, entries that name no device) from e.g. ASCEND_RT_VISIBLE_DEVICES."""
    value = envs.get(env_name)
    if value is None:
        return list(range(num_devices)), []
    ids, bad = [], []
    for entry in (e.strip() for e in value.split(",") if e.strip()):
        if entry.isdigit() and int(entry) < num_devices:
            ids.append(int(entry))
        else:
            bad.append(entry)
    return ids, bad


def check_devices(ctx: DoctorContext) -> Check:
    if ctx.platform == "npu":
        return _ascend_devices(ctx)
    if ctx.platform == "cuda":
        return _cuda_devices(ctx)
    return passed("devices", f"CPU platform: {os.cpu_count()} cores (no accelerator needed)")


def _ascend_devices(ctx: DoctorContext) -> Check:
    if ctx.npu_smi is None:
        return fail(
            "devices",
            f"cannot list NPUs: {ctx.npu_smi_error}",
            "install the driver; in containers add -v /usr/local/bin/npu-smi:/usr/local/bin/"
            f"npu-smi -v /usr/local/dcmi:/usr/local/dcmi and {_DEVICE_MOUNTS}",
        )
    chips = ctx.npu_smi.chips
    if not chips:
        return fail("devices", "npu-smi info lists no NPUs", f"map the devices: {_DEVICE_MOUNTS}")
    ids, bad = visible_ids(len(chips), "ASCEND_RT_VISIBLE_DEVICES")
    if bad:
        return fail(
            "devices",
            f"ASCEND_RT_VISIBLE_DEVICES names {','.join(bad)} but only NPUs 0..{len(chips) - 1} "
            "exist here ('Invalid device id' at startup)",
            f"use ids 0..{len(chips) - 1} of the devices mapped into this container",
        )
    sick = [
        f"NPU {c.npu_id} {c.health}" for i, c in enumerate(chips) if i in ids and c.health != "OK"
    ]
    if sick:
        return fail("devices", f"unhealthy: {', '.join(sick)}", "npu-smi info -t health -i <id>")
    return _enough_for_tp(ctx, "NPU", len(ids), _describe(chips, ids))


def _describe(chips: tuple[NpuChip, ...], ids: list[int]) -> str:
    names = sorted({chips[i].name for i in ids})
    return f"{len(ids)} of {len(chips)} NPUs visible ({', '.join(names)}), health OK"


def _enough_for_tp(ctx: DoctorContext, kind: str, count: int, description: str) -> Check:
    if ctx.tensor_parallel_size > count:
        return fail(
            "devices",
            f"--tensor-parallel-size {ctx.tensor_parallel_size} needs that many {kind}s "
            f"but {count} are visible",
            f"lower --tensor-parallel-size to {count} or make more {kind}s visible",
        )
    return passed("devices", description)


def _cuda_devices(ctx: DoctorContext) -> Check:
    probe = run_python_probe("import torch; print(torch.cuda.device_count())")
    if not probe.ok:
        return fail(
            "devices",
            f"import torch failed: {last_line(probe.stderr)}",
            "reinstall torch: pip install torch --index-url https://download.pytorch.org/whl/cu128",
        )
    count = int(probe.stdout.split()[-1]) if probe.stdout else 0
    if count == 0:
        return fail(
            "devices",
            f"torch {installed_version('torch')} sees no CUDA device",
            "install a CUDA build of torch (pip install torch --index-url "
            "https://download.pytorch.org/whl/cu128) and check nvidia-smi and CUDA_VISIBLE_DEVICES",
        )
    return _enough_for_tp(ctx, "GPU", count, f"{count} CUDA devices visible")


def check_busy(ctx: DoctorContext) -> Check:
    if ctx.platform == "npu":
        return _npu_busy(ctx)
    if ctx.platform == "cuda":
        return _gpu_busy()
    return skip("busy", "CPU platform")


def _npu_busy(ctx: DoctorContext) -> Check:
    if ctx.npu_smi is None or not ctx.npu_smi.chips:
        return skip("busy", "no npu-smi table to read")
    chips = ctx.npu_smi.chips
    ids, _ = visible_ids(len(chips), "ASCEND_RT_VISIBLE_DEVICES")
    busy: dict[int, str] = {}
    for i in ids:
        chip = chips[i]
        procs = [
            p for p in ctx.npu_smi.processes if (p.npu_id, p.chip_id) == (chip.npu_id, chip.chip_id)
        ]
        if procs or chip.hbm_used_mb > _BUSY_HBM_FRACTION * max(chip.hbm_total_mb, 1):
            owners = (
                ", ".join(f"pid {p.pid} {p.memory_mb} MB" for p in procs) or "no process listed"
            )
            busy[i] = f"NPU {i} ({chip.hbm_used_mb}/{chip.hbm_total_mb} MB HBM; {owners})"
    if not busy:
        return passed("busy", f"no other process on the {len(ids)} visible NPUs")
    return _busy_verdict(busy, ids, "ASCEND_RT_VISIBLE_DEVICES", ctx.npu_smi.processes)


def _busy_verdict(busy: dict[int, str], ids: list[int], env_name: str, procs: tuple) -> Check:
    pids = " ".join(sorted({str(p.pid) for p in procs}))
    free = [str(i) for i in ids if i not in busy]
    stop = f"stop the other processes (kill {pids})" if pids else "stop the other processes"
    reason = f"in use by other processes: {'; '.join(busy.values())}"
    if not free:
        return fail("busy", reason, stop)
    return warn("busy", reason, f"{stop} or set {env_name}={','.join(free)}")


def _gpu_busy() -> Check:
    smi = shutil.which("nvidia-smi", path=envs.get("PATH"))
    if smi is None:
        return skip("busy", "nvidia-smi not found")
    query = [smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return warn("busy", f"nvidia-smi failed: {e}", "run nvidia-smi to check the driver")
    apps = [line.split(",") for line in out.splitlines() if line.strip()]
    if not apps:
        return passed("busy", "no other process on the GPUs")
    owners = ", ".join(f"pid {a[0].strip()} {a[-1].strip()} MiB" for a in apps)
    return warn("busy", f"GPUs in use by: {owners}", "stop them or set CUDA_VISIBLE_DEVICES")


def check_torch_npu_import(ctx: DoctorContext) -> Check:
    if installed_version("torch_npu") is None:
        return skip("torch_npu_import", "torch_npu is not installed")
    probe = run_python_probe("import torch_npu\nprint(torch_npu.npu.device_count())")
    if not probe.ok:
        return fail(
            "torch_npu_import",
            f"import torch_npu failed: {last_line(probe.stderr)}",
            _fix_from_knowledge_base(probe.stderr),
        )
    count = int(probe.stdout.split()[-1]) if probe.stdout.split() else 0
    expected = len(ctx.npu_smi.chips) if ctx.npu_smi else None
    ids, _ = visible_ids(expected or 0, "ASCEND_RT_VISIBLE_DEVICES")
    if expected is not None and count != len(ids):
        return warn(
            "torch_npu_import",
            f"torch_npu sees {count} NPUs but npu-smi shows {len(ids)} visible",
            "check ASCEND_RT_VISIBLE_DEVICES and the /dev/davinci* devices mapped in",
        )
    return passed("torch_npu_import", f"import torch_npu works and sees {count} NPUs")


def _fix_from_knowledge_base(stderr: str) -> str:
    """The same knowledge base as ``qwenserve diagnose``, so both tools give one fix."""
    from qwenserve.tools.diagnose import diagnose_text

    verdict = diagnose_text(stderr)
    if verdict.rule is not None:
        return verdict.fix
    return "run python -c 'import torch_npu' to read the full error"
