"""What the checks need to know about this run, gathered once and passed to every check."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

from qwenserve import envs
from qwenserve.tools.doctor import ascend
from qwenserve.tools.doctor.npu_smi import NpuSmiInfo, parse_npu_smi

PLATFORMS = ("auto", "npu", "cuda", "cpu")


@dataclasses.dataclass(frozen=True)
class DoctorContext:
    """``npu_smi`` is parsed once (``npu_smi_error`` says why not) because three checks read it."""

    platform: str
    ascend_root: Path
    model_dir: Path | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    tensor_parallel_size: int = 1
    multi_node: bool = False
    npu_smi: NpuSmiInfo | None = None
    npu_smi_error: str | None = None


def detect_platform(ascend_root: Path) -> str:
    """Ascend when its driver or npu-smi is present, CUDA when nvidia-smi is, else CPU."""
    if ascend.npu_smi_path() or (ascend_root / "driver").is_dir():
        return "npu"
    if shutil.which("nvidia-smi", path=envs.get("PATH")) or Path("/proc/driver/nvidia").is_dir():
        return "cuda"
    return "cpu"


def read_npu_smi() -> tuple[NpuSmiInfo | None, str | None]:
    executable = ascend.npu_smi_path()
    if executable is None:
        return None, "npu-smi not found on PATH"
    try:
        return parse_npu_smi(ascend.run_npu_smi(executable)), None
    except subprocess.CalledProcessError as e:
        detail = (e.stderr or e.stdout or "").strip().splitlines()
        return None, f"`npu-smi info` exited with {e.returncode}: {detail[-1] if detail else ''}"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"`npu-smi info` failed: {e}"


def installed_version(distribution: str) -> str | None:
    """Version from package metadata: no import, so a broken torch_npu cannot crash doctor."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    ok: bool
    stdout: str
    stderr: str


def run_python_probe(code: str, timeout_s: float = 180.0) -> ProbeResult:
    """Run ``code`` in a fresh interpreter: importing torch_npu may abort or hang the process."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(False, "", f"timed out after {timeout_s:.0f} s")
    return ProbeResult(done.returncode == 0, done.stdout.strip(), done.stderr.strip())


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def ld_library_dirs() -> list[str]:
    return [entry for entry in (envs.get("LD_LIBRARY_PATH") or "").split(":") if entry]
