"""Reading an Ascend host: the version files the installers write and ``npu-smi info``.

Paths follow the layout of /usr/local/Ascend (the root can be moved with ``--ascend-root``, which is
how tests build fake machines): ``driver/version.info`` (``Version=24.1.0.3``),
``firmware/version.info``, ``ascend-toolkit/latest/version.cfg``
(``runtime_running_version=[7.3.0.1.231:8.0.RC2]``: the CANN version is after the colon),
``ascend-toolkit/latest/<arch>-linux/ascend_toolkit_install.info`` (``version=8.3.RC2``) and, for
CANN >= 8.5, ``cann-<version>/`` folders.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

from qwenserve import envs

DEFAULT_ASCEND_ROOT = "/usr/local/Ascend"


def read_key_values(path: Path) -> dict[str, str]:
    """``key=value`` lines (Ascend .info/.cfg files); missing or unreadable files give {}."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def driver_version(root: Path) -> str | None:
    return _version_from_info(root / "driver" / "version.info")


def firmware_version(root: Path) -> str | None:
    return _version_from_info(root / "firmware" / "version.info")


def _version_from_info(path: Path) -> str | None:
    values = read_key_values(path)
    return values.get("Version") or values.get("version") or None


@dataclasses.dataclass(frozen=True)
class CannInstall:
    """What each file says the CANN version is (``sources``: path -> version)."""

    sources: dict[str, str]
    set_env: Path | None

    @property
    def version(self) -> str | None:
        return next(iter(self.sources.values()), None)

    @property
    def consistent(self) -> bool:
        return len(set(self.sources.values())) <= 1


def find_cann(root: Path) -> CannInstall:
    sources: dict[str, str] = {}
    latest = root / "ascend-toolkit" / "latest"
    infos = sorted(latest.glob("*-linux/ascend_toolkit_install.info"))
    for info in [*infos, latest / "ascend_toolkit_install.info"]:
        version = read_key_values(info).get("version")
        if version:
            sources[str(info)] = version
    cfg = latest / "version.cfg"
    version = _version_from_cfg(cfg)
    if version:
        sources[str(cfg)] = version
    if not sources:  # CANN >= 8.5 installs as cann-<version>/
        for folder in sorted(root.glob("cann-*"), reverse=True):
            sources[str(folder)] = folder.name.removeprefix("cann-")
            break
    return CannInstall(sources=sources, set_env=find_set_env(root))


def _version_from_cfg(path: Path) -> str | None:
    values = read_key_values(path)
    for key in ("toolkit_running_version", "runtime_running_version"):
        match = re.search(r":\s*([^\]\s]+)\s*\]", values.get(key, ""))
        if match:
            return match.group(1)
    return None


def find_set_env(root: Path) -> Path | None:
    candidates = [root / "ascend-toolkit" / "set_env.sh", *sorted(root.glob("cann-*/set_env.sh"))]
    return next((path for path in candidates if path.is_file()), None)


def find_hal_library(root: Path) -> Path | None:
    """libascend_hal.so: the driver library torch_npu cannot load without."""
    for folder in (root / "driver" / "lib64" / "driver", root / "driver" / "lib64"):
        if (folder / "libascend_hal.so").exists():
            return folder / "libascend_hal.so"
    return None


def npu_smi_path() -> str | None:
    return shutil.which("npu-smi", path=envs.get("PATH"))


def run_npu_smi(executable: str, timeout_s: float = 30.0, *args: str) -> str:
    """Raises OSError/SubprocessError (or CalledProcessError) for the caller to report."""
    done = subprocess.run(
        [executable, "info", *args], capture_output=True, text=True, timeout=timeout_s, check=True
    )
    return done.stdout


def read_board(executable: str, npu_id: int = 0) -> dict[str, str]:
    """``npu-smi info -t board -i N``: ``Key : Value`` lines such as ``Firmware Version :
    7.1.0.7.220`` and ``Compatibility : OK`` (driver and firmware agree); {} when it fails."""
    try:
        text = run_npu_smi(executable, 30.0, "-t", "board", "-i", str(npu_id))
    except (OSError, subprocess.SubprocessError):
        return {}
    pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs if key.strip()}
