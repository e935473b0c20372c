"""doctor's host checks and building blocks: versions, the compatibility table, npu-smi parsing,
Python/torch, port, disk, CUDA hosts, and the guarantee that one crashing check is only a FAIL."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from collections import namedtuple

import pytest
from ops_helpers import DATA, by_id, run_doctor, write_executable

from qwenserve.tools import doctor
from qwenserve.tools.doctor import checks_system, compat
from qwenserve.tools.doctor.npu_smi import parse_npu_smi
from qwenserve.tools.doctor.versions import base_version, compare

pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.mark.parametrize(
    ("older", "newer"),
    [("8.3.RC2", "8.3.0"), ("8.2.RC1", "8.3.RC2"), ("8.5.0", "8.5.1"), ("24.1.rc3.3", "25.0.rc1.1"),
     ("2.10.0", "2.10.0.post4"), ("2.7.1.dev20250724", "2.7.1"), ("3.9.18", "3.10"),
     ("9.0.1", "9.1.0")],
)  # fmt: skip
def test_version_order(older, newer):
    assert compare(older, newer) == -1 and compare(newer, older) == 1


def test_versions_equal_up_to_trailing_zeros_and_local_suffix():
    assert compare("9.1", "9.1.0") == 0 and compare("2.13.0+cpu", "2.13.0") == 0


def test_base_version_is_what_torch_npu_pairs_on():
    assert base_version("2.10.0.post4") == "2.10.0"
    assert base_version("2.9.0.post1+git4c901a4") == "2.9.0"
    assert base_version("2.13.0+cpu") == "2.13.0"


def test_every_compatibility_row_pairs_torch_npu_with_its_torch():
    for row in compat.COMPAT_TABLE:
        assert compat.torch_npu_pairs_with(row.torch_npu, row.torch), row
        assert compare(row.python_min, row.python_max) < 0, row


def test_compatibility_lookups():
    assert compat.newest_row_for_cann("9.1.0").torch_npu == "2.10.0.post4"
    assert {r.cann for r in compat.rows_for_torch_npu("2.9.0.post1+git4c901a4")} == {"8.5.1"}
    assert compat.min_observed_driver("9.1.0") == ("8.3.RC2", "25.0.rc1.1")
    assert compat.min_observed_driver("8.2.RC1") == ("8.1.RC1", "24.1.rc3.3")
    assert compat.min_observed_driver("8.0.RC2") is None


def test_parse_npu_smi_research_sample():
    info = parse_npu_smi((DATA / "npu-smi-910b2.txt").read_text())
    assert info.version == "25.0.rc1.1"
    assert [(c.npu_id, c.name, c.health, c.hbm_used_mb, c.hbm_total_mb) for c in info.chips] == [
        (0, "910B2", "OK", 3414, 65536),
        (1, "910B2", "OK", 61258, 65536),
    ]
    assert [(p.npu_id, p.pid, p.memory_mb) for p in info.processes] == [(1, 30336, 3790)]


def test_parse_npu_smi_a3_layout_with_two_chips_per_npu():
    info = parse_npu_smi((DATA / "npu-smi-a3.txt").read_text())
    assert [(c.npu_id, c.chip_id, c.hbm_used_mb) for c in info.chips] == [
        (0, 0, 3159),
        (0, 1, 2866),
    ]
    assert info.processes == ()


def test_cpu_host_runs_only_the_shared_checks(capsys, tmp_path):
    code, report = run_doctor(capsys, "--platform", "cpu", "--ascend-root", str(tmp_path))
    checks = by_id(report)
    assert report["platform"] == "cpu"
    assert {
        "python",
        "torch",
        "devices",
        "busy",
        "collective_env",
        "disk",
        "memory",
        "port",
    } == set(checks)
    assert checks["torch"]["status"] == "PASS" and checks["busy"]["status"] == "SKIP"
    assert code == (1 if report["summary"]["fail"] else 0)


def test_port_in_use_fails(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        from qwenserve.entrypoints.cli import main

        code = main(
            ["doctor", "--json", "--platform", "cpu", "--host", "127.0.0.1", "--port", str(port)]
        )
    check = by_id(json.loads(capsys.readouterr().out))["port"]
    assert code == 1 and check["status"] == "FAIL" and f"ss -lntp | grep :{port}" in check["fix"]


def test_old_python_fails(capsys, monkeypatch):
    monkeypatch.setattr(checks_system.platform, "python_version", lambda: "3.9.18")
    code, report = run_doctor(capsys, "--platform", "cpu")
    assert code == 1 and by_id(report)["python"]["reason"] == "Python 3.9.18 is too old"


def test_missing_torch_fails_with_the_platform_install_command(capsys, monkeypatch):
    monkeypatch.setattr(checks_system, "installed_version", lambda name: None)
    code, report = run_doctor(capsys, "--platform", "cpu")
    check = by_id(report)["torch"]
    assert code == 1 and "whl/cpu" in check["fix"]


Usage = namedtuple("Usage", "total used free")


@pytest.mark.parametrize(("free_gib", "status"), [(0.5, "FAIL"), (8, "WARN"), (500, "PASS")])
def test_free_disk(capsys, monkeypatch, free_gib, status):
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: Usage(1 << 40, 0, int(free_gib * (1 << 30)))
    )
    _, report = run_doctor(capsys, "--platform", "cpu")
    assert by_id(report)["disk"]["status"] == status


def test_a_crashing_check_is_reported_and_the_others_still_run(capsys, monkeypatch):
    def explode(ctx):
        raise RuntimeError("boom")

    explode.__name__ = "check_port"
    monkeypatch.setattr(doctor, "_DEVICES", (*doctor._DEVICES[:-1], explode))
    code, report = run_doctor(capsys, "--platform", "cpu")
    checks = by_id(report)
    assert code == 1 and "crashed: RuntimeError('boom')" in checks["port"]["reason"]
    assert checks["python"]["status"] == "PASS"


def test_cuda_host_with_a_cpu_torch_and_a_busy_gpu(capsys, monkeypatch, tmp_path):
    """A fake nvidia-smi makes this a CUDA host; the installed torch is the CPU build."""
    write_executable(tmp_path / "bin" / "nvidia-smi", "#!/bin/sh\necho '4711, 20480'\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{__import__('os').environ['PATH']}")
    code, report = run_doctor(capsys, "--ascend-root", str(tmp_path / "none"))
    checks = by_id(report)
    assert report["platform"] == "cuda" and code == 1
    assert checks["torch"]["status"] == "FAIL" and "CPU-only build" in checks["torch"]["reason"]
    assert (
        checks["devices"]["status"] == "FAIL"
        and "sees no CUDA device" in checks["devices"]["reason"]
    )
    assert checks["busy"]["status"] == "WARN" and "pid 4711 20480 MiB" in checks["busy"]["reason"]


def test_doctor_diagnose_and_deploy_do_not_import_torch():
    code = (
        "import sys, qwenserve.tools.doctor, qwenserve.tools.diagnose, qwenserve.tools.deploy.cli\n"
        "from qwenserve.entrypoints.cli import build_parser\n"
        "for name in ('doctor', 'diagnose', 'deploy'): build_parser(name)\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
