"""Host checks every platform shares: Python, torch, disk, memory and the server port."""

from __future__ import annotations

import platform
import shutil
import socket
from pathlib import Path

import psutil

from qwenserve import envs
from qwenserve.tools.doctor import compat
from qwenserve.tools.doctor.checks_model import weights_bytes as weights_bytes_of
from qwenserve.tools.doctor.context import DoctorContext, installed_version
from qwenserve.tools.doctor.result import Check, fail, passed, warn
from qwenserve.tools.doctor.versions import compare, in_range

GIB = 1 << 30
MIN_PYTHON = "3.10"  # pyproject requires-python
_DEFAULT_CPU_KV_GIB = 4.0  # vLLM's default when VLLM_CPU_KVCACHE_SPACE is unset


def check_python(ctx: DoctorContext) -> Check:
    version = platform.python_version()
    if compare(version, MIN_PYTHON) < 0:
        return fail("python", f"Python {version} is too old", f"use Python >= {MIN_PYTHON}")
    torch_npu = installed_version("torch_npu") if ctx.platform == "npu" else None
    rows = compat.rows_for_torch_npu(torch_npu) if torch_npu else []
    if rows and not in_range(version, rows[0].python_min, rows[0].python_max):
        row = rows[0]
        return warn(
            "python",
            f"Python {version} is outside {row.python_min} <= python < {row.python_max}, "
            f"the range torch_npu {torch_npu} is built for",
            f"use a Python in [{row.python_min}, {row.python_max})",
        )
    return passed("python", f"Python {version}")


def check_torch(ctx: DoctorContext) -> Check:
    version = installed_version("torch")
    if version is None:
        return fail("torch", "torch is not installed", _torch_install_hint(ctx.platform))
    if ctx.platform == "cuda" and version.endswith("+cpu"):
        return fail(
            "torch",
            f"torch {version} is a CPU-only build on a CUDA host",
            _torch_install_hint("cuda"),
        )
    return passed("torch", f"torch {version}")


def _torch_install_hint(platform_name: str) -> str:
    row = compat.RECOMMENDED
    if platform_name == "npu":
        return f"pip install torch=={row.torch} torch_npu=={row.torch_npu} (CANN {row.cann})"
    if platform_name == "cuda":
        return "pip install torch --index-url https://download.pytorch.org/whl/cu128"
    return "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def _disk_target(ctx: DoctorContext) -> Path:
    if ctx.model_dir is not None and ctx.model_dir.exists():
        return ctx.model_dir
    hub = Path(envs.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    return next((p for p in (hub, *hub.parents) if p.exists()), Path("/"))


def check_disk(ctx: DoctorContext) -> Check:
    """Downloads, compile caches and logs need room; a full disk fails mid-download."""
    target = _disk_target(ctx)
    free = shutil.disk_usage(target).free
    need = 5 * GIB if ctx.model_dir is not None else 20 * GIB  # no model yet: room to fetch one
    message = f"{free / GIB:.1f} GiB free at {target}"
    if free < GIB:
        return fail("disk", message, f"free space at {target} (logs and caches need a few GiB)")
    if free < need:
        return warn("disk", f"{message} (< {need // GIB} GiB)", f"free space at {target}")
    return passed("disk", message)


def check_memory(ctx: DoctorContext) -> Check:
    """On CPU the weights and the KV cache both live in RAM; elsewhere loading stages through it."""
    weights_bytes = weights_bytes_of(ctx.model_dir)
    available = psutil.virtual_memory().available
    message = f"{available / GIB:.1f} GiB RAM available"
    if ctx.platform == "cpu" and weights_bytes:
        kv_gib = envs.cpu_kvcache_space_gib() or _DEFAULT_CPU_KV_GIB
        need = weights_bytes + int(kv_gib * GIB)
        if available < need:
            return fail(
                "memory",
                f"{message}; the CPU server needs ~{need / GIB:.1f} GiB "
                f"(weights {weights_bytes / GIB:.1f} + KV cache {kv_gib:g})",
                "lower QWENSERVE_CPU_KVCACHE_SPACE, use a smaller or quantized model, "
                "or free memory",
            )
    elif available < 8 * GIB:
        return warn(
            "memory", f"{message} (< 8 GiB)", "free host memory: loading stages weights in RAM"
        )
    return passed("memory", message)


def check_port(ctx: DoctorContext) -> Check:
    family = socket.AF_INET6 if ":" in ctx.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((ctx.host, ctx.port))
        except OSError as e:
            return fail(
                "port",
                f"cannot bind {ctx.host}:{ctx.port}: {e.strerror or e}",
                f"find the owner with `ss -lntp | grep :{ctx.port}` and stop it, "
                "or pick another --port",
            )
    return passed("port", f"{ctx.host}:{ctx.port} is free")
