"""Ascend checks: driver, firmware, CANN, the sourced environment and torch_npu's pairing."""

from __future__ import annotations

import os
from pathlib import Path

from qwenserve import envs
from qwenserve.tools.doctor import ascend, compat
from qwenserve.tools.doctor.context import DoctorContext, installed_version, ld_library_dirs
from qwenserve.tools.doctor.result import Check, fail, passed, skip, warn
from qwenserve.tools.doctor.versions import base_version, compare


def _cann(ctx: DoctorContext) -> ascend.CannInstall:
    return ascend.find_cann(ctx.ascend_root)


def _set_env_hint(ctx: DoctorContext) -> str:
    found = ascend.find_set_env(ctx.ascend_root)
    return str(found or ctx.ascend_root / "ascend-toolkit" / "set_env.sh")


def check_driver(ctx: DoctorContext) -> Check:
    version = ascend.driver_version(ctx.ascend_root)
    source = str(ctx.ascend_root / "driver" / "version.info")
    if version is None and ctx.npu_smi is not None and ctx.npu_smi.version:
        version, source = ctx.npu_smi.version, "npu-smi info"
    if version is None:
        return fail(
            "driver",
            f"no Ascend driver: {source} is missing and npu-smi gave no version",
            f"install the Ascend HDK npu-driver, or mount {ctx.ascend_root}/driver into the "
            "container (-v /usr/local/Ascend/driver:/usr/local/Ascend/driver)",
        )
    cann = _cann(ctx).version
    pair = compat.min_observed_driver(cann) if cann else None
    if pair is not None and compare(version, pair[1]) < 0:
        return warn(
            "driver",
            f"driver {version} is older than {pair[1]}, the oldest seen working with CANN "
            f">= {pair[0]} (installed CANN {cann})",
            f"install the HDK driver and firmware listed in the CANN {cann} release notes",
        )
    return passed("driver", f"driver {version} (from {source})")


def check_firmware(ctx: DoctorContext) -> Check:
    """``firmware/version.info``, else ``npu-smi info -t board``; its ``Compatibility`` line is
    the device's own verdict on the driver/firmware pair."""
    version = ascend.firmware_version(ctx.ascend_root)
    source = f"{ctx.ascend_root}/firmware/version.info"
    executable = ascend.npu_smi_path() if ctx.npu_smi is not None else None
    board = ascend.read_board(executable) if executable else {}
    if version is None and board.get("Firmware Version"):
        version, source = board["Firmware Version"], "npu-smi info -t board"
    if version is None:
        return skip(
            "firmware",
            f"{ctx.ascend_root}/firmware/version.info not found (containers rarely mount it) and "
            "npu-smi gave no board information; on the host: npu-smi info -t board -i 0",
        )
    compatibility = board.get("Compatibility", "OK")
    if compatibility.upper() != "OK":
        return warn(
            "firmware",
            f"firmware {version}: npu-smi reports Compatibility {compatibility} with the driver",
            "install the driver and firmware of one HDK release (the CANN release notes list it)",
        )
    return passed("firmware", f"firmware {version} (from {source})")


def check_cann(ctx: DoctorContext) -> Check:
    cann = _cann(ctx)
    if cann.version is None:
        return fail(
            "cann",
            f"no CANN toolkit under {ctx.ascend_root} (no ascend-toolkit/latest/version.cfg, "
            "ascend_toolkit_install.info or cann-* folder)",
            f"install Ascend-cann-toolkit {compat.RECOMMENDED.cann} and the matching 910b kernels "
            "package, or pass --ascend-root where it is installed",
        )
    if not cann.consistent:
        found = ", ".join(f"{path}: {v}" for path, v in cann.sources.items())
        return warn(
            "cann",
            f"CANN version files disagree ({found})",
            "re-point ascend-toolkit/latest at one install",
        )
    return _cann_against_table(cann.version)


def _cann_against_table(cann: str) -> Check:
    torch_npu = installed_version("torch_npu")
    rows = compat.rows_for_torch_npu(torch_npu) if torch_npu else []
    if rows and not any(compare(row.cann, cann) == 0 for row in rows):
        wanted = " or ".join(sorted({row.cann for row in rows}))
        match = compat.newest_row_for_cann(cann)
        alternative = f"torch_npu=={match.torch_npu} for CANN {cann}, or " if match else ""
        return warn(
            "cann",
            f"CANN {cann} is installed but torch_npu {torch_npu} is tested with CANN {wanted}",
            f"install {alternative}CANN {wanted}",
        )
    if not compat.rows_for_cann(cann):
        return warn(
            "cann",
            f"CANN {cann} is not in the compatibility table "
            f"(known: {', '.join(compat.known_canns())})",
            f"use a tested CANN, e.g. {compat.RECOMMENDED.cann} with torch_npu "
            f"{compat.RECOMMENDED.torch_npu}",
        )
    return passed("cann", f"CANN {cann}" + (f", tested with torch_npu {torch_npu}" if rows else ""))


def check_torch_npu(ctx: DoctorContext) -> Check:
    torch_npu, torch = installed_version("torch_npu"), installed_version("torch")
    cann = _cann(ctx).version
    row = (compat.newest_row_for_cann(cann) if cann else None) or compat.RECOMMENDED
    pair = f"pip install torch=={row.torch} torch_npu=={row.torch_npu}"
    if torch_npu is None:
        return fail(
            "torch_npu", "torch_npu is not installed", f"{pair} (the pair for CANN {row.cann})"
        )
    if torch is None or not compat.torch_npu_pairs_with(torch_npu, torch):
        return fail(
            "torch_npu",
            f"torch_npu {torch_npu} is built for torch {base_version(torch_npu)} "
            f"but torch {torch or '(none)'} is installed",
            f"pip install torch=={base_version(torch_npu)}",
        )
    if not compat.rows_for_torch_npu(torch_npu):
        return warn(
            "torch_npu",
            f"torch_npu {torch_npu} (torch {torch}) is not in the compatibility table",
            f"{pair} (tested with CANN {row.cann})",
        )
    return passed("torch_npu", f"torch_npu {torch_npu} pairs with torch {torch}")


def check_cann_env(ctx: DoctorContext) -> Check:
    fix = f"source {_set_env_hint(ctx)}"
    home = envs.get("ASCEND_HOME_PATH") or envs.get("ASCEND_TOOLKIT_HOME")
    if home is None:
        return fail("cann_env", "ASCEND_HOME_PATH is not set: set_env.sh was not sourced", fix)
    if not Path(home).is_dir():
        return fail("cann_env", f"ASCEND_HOME_PATH={home} does not exist", fix)
    lib64 = os.path.realpath(os.path.join(home, "lib64"))
    if lib64 not in {os.path.realpath(entry) for entry in ld_library_dirs()}:
        return fail("cann_env", f"LD_LIBRARY_PATH lacks the toolkit libraries {lib64}", fix)
    return passed("cann_env", f"ASCEND_HOME_PATH={home}; toolkit libs on LD_LIBRARY_PATH")


def check_driver_libs(ctx: DoctorContext) -> Check:
    hal = ascend.find_hal_library(ctx.ascend_root)
    lib64 = ctx.ascend_root / "driver" / "lib64"
    if hal is None:
        return fail(
            "driver_libs",
            f"libascend_hal.so not found under {lib64}: torch_npu will not load",
            f"reinstall the driver, or mount it: -v {lib64}/:{lib64}/",
        )
    folder = os.path.realpath(hal.parent)
    on_path = folder in {os.path.realpath(entry) for entry in ld_library_dirs()}
    if not on_path and not _in_ld_so_conf(str(hal.parent)):
        return warn(
            "driver_libs",
            f"{hal.parent} is neither on LD_LIBRARY_PATH nor in /etc/ld.so.conf.d",
            f"export LD_LIBRARY_PATH={lib64}/driver:{lib64}/common:$LD_LIBRARY_PATH",
        )
    return passed("driver_libs", f"{hal} found and on the library path")


def _in_ld_so_conf(folder: str) -> bool:
    for conf in Path("/etc/ld.so.conf.d").glob("*.conf"):
        try:
            if folder in conf.read_text(errors="replace"):
                return True
        except OSError:
            continue
    return False
