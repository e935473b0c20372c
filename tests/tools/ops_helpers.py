"""Factories for the operator-tool tests (doctor, diagnose, deploy): fake Ascend 910B hosts, fake
packages, tiny models.

A fake host is a folder laid out like /usr/local/Ascend (version files, set_env.sh, driver
library) plus an ``npu-smi`` shell script on PATH that prints a table in the real format, so
doctor runs its normal code paths against it through ``--ascend-root`` and PATH.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from helpers.ports import free_port
from qwenserve.entrypoints.cli import main

DATA = Path(__file__).parent / "data"
ENV_TO_CLEAR = (
    "ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_RT_VISIBLE_DEVICES", "HCCL_IF_IP",
    "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "HCCL_CONNECT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT", "HCCL_BUFFSIZE", "VLLM_HOST_IP", "NCCL_SOCKET_IFNAME", "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES", "PYTHONPATH",
)  # fmt: skip


def clear_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host settings that would leak into doctor's checks (the CI machine's own CUDA, CANN...)."""
    for name in ENV_TO_CLEAR:
        monkeypatch.delenv(name, raising=False)


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str = "910B3"
    health: str = "OK"
    hbm_used_mb: int = 3414
    hbm_total_mb: int = 65536


def npu_smi_table(
    chips: Sequence[Chip],
    processes: Sequence[tuple[int, int, int]] = (),
    version: str = "25.0.rc1.1",
) -> str:
    """``npu-smi info`` as an Atlas 800 A2 prints it; processes are (npu, pid, memory MB)."""
    rule = "+---------------------------+---------------+----------------------------------------------------+"
    double = "+===========================+===============+====================================================+"
    lines = [
        "+------------------------------------------------------------------------------------------------+",
        f"| npu-smi {version:<24} Version: {version:<38}|",
        rule,
        "| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|",
        "| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |",
        double,
    ]
    for i, chip in enumerate(chips):
        bus = f"0000:{0xC1 + i:02X}:00.0"
        lines.append(
            f"| {i:<5} {chip.name:<19} | {chip.health:<13} | 95.5        43                0    / 0             |"
        )
        hbm = f"{chip.hbm_used_mb:<5}/ {chip.hbm_total_mb}"
        lines.append(
            f"| 0                         | {bus:<13} | 0           0    / 0          {hbm:<21}|"
        )
        lines.append(double)
    lines += [
        rule,
        "| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |",
        double,
    ]
    for i in range(len(chips)):
        owned = [p for p in processes if p[0] == i]
        if not owned:
            lines.append(f"| No running processes found in NPU {i:<62}|")
        for npu, pid, memory in owned:
            lines.append(
                f"| {npu:<7} 0                 | {pid:<13} | python                   | {memory:<24}|"
            )
        lines.append(double)
    return "\n".join(lines) + "\n"


def write_executable(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@dataclasses.dataclass
class FakeAscendHost:
    root: Path
    bin_dir: Path
    site_dir: Path

    @property
    def toolkit(self) -> Path:
        return self.root / "ascend-toolkit" / "latest"

    def set_npu_smi(self, table: str, exit_code: int = 0, board: str | None = None) -> None:
        """``npu-smi info`` prints ``table``; ``npu-smi info -t board -i N`` prints ``board``
        when given (else the table, which has no board keys)."""
        body = "#!/bin/sh\n"
        if board is not None:
            body += (
                f'if [ "$2" = "-t" ] && [ "$3" = "board" ]; then\n'
                f"cat <<'BOARD'\n{board}BOARD\nexit 0\nfi\n"
            )
        body += f"cat <<'TABLE'\n{table}TABLE\nexit {exit_code}\n"
        write_executable(self.bin_dir / "npu-smi", body)

    def write_cann(self, version: str, cfg_version: str | None = None) -> None:
        cfg = cfg_version or version
        components = ("runtime", "compiler", "hccl", "opp", "toolkit", "aoe", "ncs")
        self.toolkit.joinpath("version.cfg").write_text(
            "# version: 1.0\n"
            + "".join(f"{c}_running_version=[7.7.0.1.231:{cfg}]\n" for c in components)
        )
        info = self.toolkit / "x86_64-linux" / "ascend_toolkit_install.info"
        info.parent.mkdir(parents=True, exist_ok=True)
        info.write_text(
            f"package_name=Ascend-cann-toolkit\nversion={version}\n"
            "innerversion=V100R001C25SPC001B231\ncompatible_version=[V100R001C15],[V100R001C18]\n"
            f"arch=x86_64\nos=linux\npath={self.root}/ascend-toolkit/{version}/x86_64-linux\n"
        )

    def install_python_package(self, name: str, version: str, init: str = "") -> None:
        """A dist-info (what importlib.metadata reads) and, given ``init``, an importable module."""
        dist = self.site_dir / f"{name}-{version}.dist-info"
        dist.mkdir(parents=True, exist_ok=True)
        dist.joinpath("METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        if init:
            package = self.site_dir / name
            package.mkdir(exist_ok=True)
            package.joinpath("__init__.py").write_text(textwrap.dedent(init))

    def source_set_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """What ``source set_env.sh`` leaves in the environment."""
        monkeypatch.setenv("ASCEND_HOME_PATH", str(self.toolkit))
        monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(self.toolkit))
        driver = self.root / "driver" / "lib64"
        monkeypatch.setenv(
            "LD_LIBRARY_PATH", f"{self.toolkit}/lib64:{driver}/driver:{driver}/common"
        )


def npu_smi_board(firmware: str = "7.7.0.1.231", compatibility: str = "OK") -> str:
    """``npu-smi info -t board -i 0`` as the Ascend docs show it."""
    rows = [
        ("NPU ID", "0"),
        ("Software Version", "25.0.rc1.1"),
        ("Firmware Version", firmware),
        ("Compatibility", compatibility),
        ("Board ID", "0x02"),
        ("PCB ID", "A"),
        ("BOM ID", "1"),
        ("PCIe Bus Info", "0000:61:00.0"),
        ("Chip Count", "1"),
    ]
    return "".join(f"        {key:<31}: {value}\n" for key, value in rows)


WORKING_TORCH_NPU = """
    import types
    npu = types.SimpleNamespace(device_count=lambda: 8)
"""
BROKEN_TORCH_NPU = """
    raise ImportError("libascend_hal.so: cannot open shared object file: No such file or directory")
"""


def build_ascend_host(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    cann: str = "9.1.0",
    driver: str = "25.0.rc1.1",
    num_chips: int = 8,
) -> FakeAscendHost:
    """A healthy 8 x 910B3 host with CANN 9.1.0, torch 2.10.0 + torch_npu 2.10.0.post4, sourced."""
    root, bin_dir, site = tmp_path / "Ascend", tmp_path / "bin", tmp_path / "site"
    host = FakeAscendHost(root, bin_dir, site)
    (root / "driver" / "lib64" / "driver").mkdir(parents=True)
    (root / "driver" / "lib64" / "common").mkdir(parents=True)
    (root / "driver" / "lib64" / "driver" / "libascend_hal.so").write_bytes(b"\x7fELF")
    (root / "driver" / "version.info").write_text(f"Version={driver}\nascendhal_version=7.35.23\n")
    (root / "firmware").mkdir()
    (root / "firmware" / "version.info").write_text("Version=7.7.0.1.231\n")
    versioned = root / "ascend-toolkit" / cann
    (versioned / "lib64").mkdir(parents=True)
    (root / "ascend-toolkit" / "latest").symlink_to(versioned)
    write_executable(
        root / "ascend-toolkit" / "set_env.sh",
        f"export ASCEND_HOME_PATH={host.toolkit}\nexport QWENSERVE_TEST_CANN_SOURCED=1\n",
    )
    host.write_cann(cann)
    host.set_npu_smi(npu_smi_table([Chip()] * num_chips))
    host.install_python_package("torch", "2.10.0")
    host.install_python_package("torch_npu", "2.10.0.post4", WORKING_TORCH_NPU)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    host.source_set_env(monkeypatch)
    return host


def run_doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    """``qwenserve doctor --json`` through the real CLI; returns (exit code, report)."""
    code = main(["doctor", "--json", "--host", "127.0.0.1", "--port", str(free_port()), *args])
    report = json.loads(capsys.readouterr().out)
    return code, report


def by_id(report: dict) -> dict[str, dict]:
    return {check["id"]: check for check in report["checks"]}


# --- deploy -----------------------------------------------------------------------------------


def require_tool(name: str, package: str) -> str:
    """The tool's path, or skip naming the Debian package CI must install."""
    import shutil

    path = shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.path.exists(p)), None
    )
    if path is None:
        pytest.skip(f"{name} not installed (apt-get install {package})")
    return path


def run_deploy(out: Path, target: str, *options: str, serve: Sequence[str] = ()) -> dict[str, Path]:
    """``qwenserve deploy TARGET --output-dir OUT OPTIONS -- SERVE`` -> {file name: path}."""
    argv = ["deploy", target, "--output-dir", str(out), *options]
    if serve:
        argv += ["--", *serve]
    assert main(argv) == 0
    return {p.name: p for p in out.rglob("*") if p.is_file()}


def fake_qwenserve(folder: Path) -> Path:
    """An executable that prints its arguments and whether set_env.sh was sourced."""
    import sys

    return write_executable(
        folder / "qwenserve",
        f"#!{sys.executable}\nimport json, os, sys\n"
        'print(json.dumps({"argv": sys.argv[1:], '
        '"sourced": os.environ.get("QWENSERVE_TEST_CANN_SOURCED")}))\n',
    )


def fake_ascend_root(folder: Path) -> Path:
    """Just the set_env.sh the generated start commands source."""
    write_executable(
        folder / "ascend-toolkit" / "set_env.sh", "export QWENSERVE_TEST_CANN_SOURCED=1\n"
    )
    return folder


def run_command(argv: Sequence[str]) -> dict:
    import subprocess

    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=True)
    return json.loads(done.stdout)


# --- load balancer integration ------------------------------------------------------------------


def _backend_handler(name: str) -> type:
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        """Answers {"server": name}; /stream sends two SSE events one second apart."""

        protocol_version = "HTTP/1.1"

        def _reply(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/stream":
                return self._stream()
            body = json.dumps({"server": name}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _stream(self) -> None:
            import time

            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(2):
                event = f"data: {i}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                if i == 0:
                    time.sleep(1.0)
            self.wfile.write(b"0\r\n\r\n")

        do_GET = do_POST = _reply

        def log_message(self, *args: object) -> None:
            return None

    return Handler


class Backends:
    """Small HTTP servers standing in for qwenserve instances (context manager)."""

    def __init__(self, count: int) -> None:
        import threading
        from http.server import ThreadingHTTPServer

        self.servers = [
            ThreadingHTTPServer(("127.0.0.1", 0), _backend_handler(f"s{i}")) for i in range(count)
        ]
        self.threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in self.servers]

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.server_address[1]}" for s in self.servers]

    def __enter__(self) -> Backends:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


def wait_for_port(port: int, process: object, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:  # type: ignore[attr-defined]
            stderr = process.stderr.read()  # type: ignore[attr-defined]
            raise RuntimeError(f"load balancer exited: {stderr}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def http_get(port: int, path: str = "/v1/models", headers: dict[str, str] | None = None) -> dict:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        assert response.status == 200, response.status
        return json.loads(response.read())
    finally:
        conn.close()


def first_event_delay_s(port: int) -> tuple[float, float]:
    """(seconds to the first SSE event, seconds to the end) through the balancer."""
    import http.client
    import time

    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/stream")
        response = conn.getresponse()
        first = response.readline()
        assert first.startswith(b"data: 0"), first
        first_s = time.monotonic() - start
        response.read()
        return first_s, time.monotonic() - start
    finally:
        conn.close()
