"""Collective-communication settings (HCCL on Ascend, NCCL/Gloo elsewhere) for multi-device runs.

A wrong ``HCCL_IF_IP`` or NIC name is the usual cause of ``HcclCommInitRootInfo`` failures and of
minutes-long hangs at startup, and it is cheap to check before the server starts.
"""

from __future__ import annotations

import ipaddress

import psutil

from qwenserve import envs
from qwenserve.tools.doctor.context import DoctorContext
from qwenserve.tools.doctor.result import Check, fail, passed, skip, warn

_IP_VARS = {"npu": ("HCCL_IF_IP", "VLLM_HOST_IP"), "cuda": ("VLLM_HOST_IP",), "cpu": ()}
_NIC_VARS = {
    "npu": ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"),
    "cuda": ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
    "cpu": ("GLOO_SOCKET_IFNAME",),
}
_INT_VARS = {
    "npu": ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_BUFFSIZE"),
    "cuda": (),
    "cpu": (),
}


def _local_ips() -> set[str]:
    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}


def _ip_problem(name: str, value: str) -> str | None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return f"{name}={value} is not an IP address"
    if value not in _local_ips():
        return f"{name}={value} is not an address of this host"
    return None


def _nic_problem(name: str, value: str) -> str | None:
    """NCCL syntax: comma-separated prefixes, ``=`` for exact names, ``^`` to exclude."""
    if value.startswith("^"):
        return None
    exact = value.startswith("=")
    wanted = [w.strip() for w in value.lstrip("=").split(",") if w.strip()]
    nics = set(psutil.net_if_addrs())
    found = [w for w in wanted if (w in nics if exact else any(n.startswith(w) for n in nics))]
    if not found:
        return f"{name}={value} matches no interface (have: {', '.join(sorted(nics))})"
    return None


def _int_problem(name: str, value: str) -> str | None:
    return (
        None if value.isdigit() and int(value) > 0 else f"{name}={value} is not a positive integer"
    )


def _problems(platform_name: str) -> tuple[list[str], list[str]]:
    problems, seen = [], []
    checks = (
        [(n, _ip_problem) for n in _IP_VARS[platform_name]]
        + [(n, _nic_problem) for n in _NIC_VARS[platform_name]]
        + [(n, _int_problem) for n in _INT_VARS[platform_name]]
    )
    for name, validate in checks:
        value = envs.get(name)
        if value is None:
            continue
        seen.append(f"{name}={value}")
        problem = validate(name, value)
        if problem:
            problems.append(problem)
    return problems, seen


def check_collective_env(ctx: DoctorContext) -> Check:
    problems, seen = _problems(ctx.platform)
    nic = "HCCL_SOCKET_IFNAME" if ctx.platform == "npu" else "NCCL_SOCKET_IFNAME"
    if problems:
        return fail(
            "collective_env",
            "; ".join(problems),
            "set them to this host's IP and NIC (see `ip -br addr`), or unset them",
        )
    if ctx.multi_node and ctx.platform == "npu" and envs.get("HCCL_IF_IP") is None:
        return fail(
            "collective_env",
            "multi-node run without HCCL_IF_IP: HCCL will pick an interface and may hang",
            f"export HCCL_IF_IP=<this host's IP> {nic}=<nic> GLOO_SOCKET_IFNAME=<nic>",
        )
    if ctx.multi_node and not seen:
        return warn(
            "collective_env",
            "multi-node run with no NIC pinned",
            f"export {nic}=<nic> GLOO_SOCKET_IFNAME=<nic>",
        )
    if not seen and ctx.tensor_parallel_size == 1 and not ctx.multi_node:
        return skip("collective_env", "single-device run: no collective settings needed")
    if not seen:
        return passed("collective_env", "single-node tensor parallel needs no NIC settings")
    return passed("collective_env", ", ".join(seen))
