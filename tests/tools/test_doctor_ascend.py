"""doctor on fake Ascend 910B hosts: versions, environment, devices, busy NPUs, HCCL settings."""

from __future__ import annotations

import shutil

import pytest
from ops_helpers import (
    BROKEN_TORCH_NPU,
    DATA,
    Chip,
    FakeAscendHost,
    build_ascend_host,
    by_id,
    npu_smi_board,
    npu_smi_table,
    run_doctor,
)

ASCEND_CHECKS = ("torch_npu", "driver", "firmware", "cann", "cann_env", "driver_libs",
                 "torch_npu_import", "devices", "busy")  # fmt: skip

pytestmark = pytest.mark.usefixtures("clean_env")


def doctor(
    capsys: pytest.CaptureFixture[str], host: FakeAscendHost, *args: str
) -> tuple[int, dict]:
    return run_doctor(capsys, "--platform", "npu", "--ascend-root", str(host.root), *args)


def test_healthy_host_passes_every_ascend_check(ascend_host, capsys):
    code, report = doctor(capsys, ascend_host)
    checks = by_id(report)
    assert code == 0 and report["ok"] is True and report["platform"] == "npu"
    assert {name: checks[name]["status"] for name in ASCEND_CHECKS} == dict.fromkeys(
        ASCEND_CHECKS, "PASS"
    )
    assert "2.10.0.post4" in checks["torch_npu"]["reason"]
    assert "CANN 9.1.0" in checks["cann"]["reason"]
    assert "25.0.rc1.1" in checks["driver"]["reason"]
    assert "8 of 8 NPUs" in checks["devices"]["reason"]
    assert "sees 8 NPUs" in checks["torch_npu_import"]["reason"]


def test_json_report_shape(ascend_host, capsys):
    _, report = doctor(capsys, ascend_host)
    assert set(report) == {"ok", "platform", "summary", "checks"}
    assert set(report["summary"]) == {"pass", "warn", "fail", "skip"}
    assert sum(report["summary"].values()) == len(report["checks"])
    for check in report["checks"]:
        assert set(check) == {"id", "status", "reason", "fix"}
        assert check["status"] in {"PASS", "WARN", "FAIL", "SKIP"}
        assert check["reason"] and "\n" not in check["reason"]
        assert check["status"] not in {"WARN", "FAIL"} or check["fix"]


def test_text_output_shows_status_reason_and_fix(ascend_host, capsys, monkeypatch):
    from qwenserve.entrypoints.cli import main

    monkeypatch.delenv("ASCEND_HOME_PATH")
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME")
    code = main(["doctor", "--platform", "npu", "--ascend-root", str(ascend_host.root)])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL  cann_env" in out and "ASCEND_HOME_PATH is not set" in out
    assert f"fix: source {ascend_host.root}/ascend-toolkit/set_env.sh" in out


def test_busy_npu_warns_with_pid_and_free_devices(ascend_host, capsys):
    chips = [Chip(), Chip(hbm_used_mb=61258), Chip(), Chip()]
    ascend_host.set_npu_smi(npu_smi_table(chips, processes=[(1, 30336, 3790)]))
    code, report = doctor(capsys, ascend_host)
    busy = by_id(report)["busy"]
    assert code == 0 and busy["status"] == "WARN"
    assert "NPU 1" in busy["reason"] and "pid 30336 3790 MB" in busy["reason"]
    assert "kill 30336" in busy["fix"] and "ASCEND_RT_VISIBLE_DEVICES=0,2,3" in busy["fix"]


def test_every_visible_npu_busy_fails(ascend_host, capsys, monkeypatch):
    ascend_host.set_npu_smi(npu_smi_table([Chip(), Chip()], processes=[(1, 4242, 50000)]))
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "1")
    code, report = doctor(capsys, ascend_host)
    assert code == 1 and by_id(report)["busy"]["status"] == "FAIL"


def test_high_hbm_use_without_listed_process_counts_as_busy(ascend_host, capsys):
    # Processes in another container's PID namespace are not listed, but their HBM shows.
    ascend_host.set_npu_smi(npu_smi_table([Chip(), Chip(hbm_used_mb=40000)]))
    _, report = doctor(capsys, ascend_host)
    busy = by_id(report)["busy"]
    assert busy["status"] == "WARN" and "no process listed" in busy["reason"]


def test_set_env_not_sourced_fails(ascend_host, capsys, monkeypatch):
    monkeypatch.delenv("ASCEND_HOME_PATH")
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME")
    code, report = doctor(capsys, ascend_host)
    check = by_id(report)["cann_env"]
    assert code == 1 and check["status"] == "FAIL"
    assert check["fix"] == f"source {ascend_host.root}/ascend-toolkit/set_env.sh"


def test_toolkit_libs_missing_from_ld_library_path_fails(ascend_host, capsys, monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{ascend_host.root}/driver/lib64/driver")
    code, report = doctor(capsys, ascend_host)
    check = by_id(report)["cann_env"]
    assert (
        code == 1 and check["status"] == "FAIL" and "lacks the toolkit libraries" in check["reason"]
    )


def test_torch_npu_built_for_another_torch_fails(ascend_host, capsys):
    ascend_host.install_python_package("torch", "2.9.0")
    shutil.rmtree(ascend_host.site_dir / "torch-2.10.0.dist-info")
    code, report = doctor(capsys, ascend_host)
    check = by_id(report)["torch_npu"]
    assert code == 1 and check["status"] == "FAIL"
    assert "built for torch 2.10.0 but torch 2.9.0" in check["reason"]
    assert check["fix"] == "pip install torch==2.10.0"


def test_torch_npu_missing_fails_with_the_pair_for_the_installed_cann(
    tmp_path, monkeypatch, capsys
):
    host = build_ascend_host(tmp_path, monkeypatch, cann="8.5.1")
    shutil.rmtree(host.site_dir / "torch_npu-2.10.0.post4.dist-info")
    code, report = doctor(capsys, host)
    checks = by_id(report)
    assert code == 1 and checks["torch_npu"]["status"] == "FAIL"
    assert "torch==2.9.0 torch_npu==2.9.0" in checks["torch_npu"]["fix"]
    assert checks["torch_npu_import"]["status"] == "SKIP"


def test_cann_that_torch_npu_was_not_tested_with_warns(tmp_path, monkeypatch, capsys):
    host = build_ascend_host(tmp_path, monkeypatch, cann="8.5.1")
    code, report = doctor(capsys, host)
    check = by_id(report)["cann"]
    assert code == 0 and check["status"] == "WARN"
    assert "torch_npu 2.10.0.post4 is tested with CANN 9.1.0" in check["reason"]
    assert "torch_npu==2.9.0" in check["fix"]


def test_cann_outside_the_table_warns(tmp_path, monkeypatch, capsys):
    host = build_ascend_host(tmp_path, monkeypatch, cann="7.0.0")
    shutil.rmtree(host.site_dir / "torch_npu-2.10.0.post4.dist-info")
    _, report = doctor(capsys, host)
    check = by_id(report)["cann"]
    assert check["status"] == "WARN" and "not in the compatibility table" in check["reason"]


def test_cann_version_files_that_disagree_warn(ascend_host, capsys):
    ascend_host.write_cann("9.1.0", cfg_version="9.0.1")
    _, report = doctor(capsys, ascend_host)
    check = by_id(report)["cann"]
    assert (
        check["status"] == "WARN" and "disagree" in check["reason"] and "9.0.1" in check["reason"]
    )


def test_cann_9_layout_without_ascend_toolkit_is_found(ascend_host, capsys):
    shutil.rmtree(ascend_host.root / "ascend-toolkit")
    cann = ascend_host.root / "cann-9.1.0"
    cann.mkdir()
    (cann / "set_env.sh").write_text("export ASCEND_HOME_PATH=/usr/local/Ascend/cann-9.1.0\n")
    _, report = doctor(capsys, ascend_host)
    checks = by_id(report)
    assert checks["cann"]["status"] == "PASS" and "CANN 9.1.0" in checks["cann"]["reason"]
    assert checks["cann_env"]["fix"] == f"source {cann}/set_env.sh"


def test_driver_older_than_seen_with_this_cann_warns(tmp_path, monkeypatch, capsys):
    host = build_ascend_host(tmp_path, monkeypatch, driver="24.1.rc3.3")
    _, report = doctor(capsys, host)
    check = by_id(report)["driver"]
    assert check["status"] == "WARN" and "older than 25.0.rc1.1" in check["reason"]


def test_no_driver_and_no_npu_smi_fail(ascend_host, capsys):
    (ascend_host.root / "driver" / "version.info").unlink()
    (ascend_host.bin_dir / "npu-smi").unlink()
    code, report = doctor(capsys, ascend_host)
    checks = by_id(report)
    assert code == 1
    assert (
        checks["driver"]["status"] == "FAIL"
        and "/usr/local/Ascend/driver" in checks["driver"]["fix"]
    )
    assert (
        checks["devices"]["status"] == "FAIL" and "npu-smi not found" in checks["devices"]["reason"]
    )


def test_driver_version_falls_back_to_npu_smi(ascend_host, capsys):
    (ascend_host.root / "driver" / "version.info").unlink()
    _, report = doctor(capsys, ascend_host)
    check = by_id(report)["driver"]
    assert check["status"] == "PASS" and "npu-smi info" in check["reason"]


def test_missing_hal_library_and_failing_torch_npu_import(ascend_host, capsys):
    (ascend_host.root / "driver" / "lib64" / "driver" / "libascend_hal.so").unlink()
    ascend_host.install_python_package("torch_npu", "2.10.0.post4", BROKEN_TORCH_NPU)
    code, report = doctor(capsys, ascend_host)
    checks = by_id(report)
    assert code == 1
    assert checks["driver_libs"]["status"] == "FAIL"
    assert "libascend_hal.so not found" in checks["driver_libs"]["reason"]
    imported = checks["torch_npu_import"]
    assert imported["status"] == "FAIL" and "libascend_hal.so" in imported["reason"]
    assert "/usr/local/Ascend/driver/lib64" in imported["fix"]  # from the diagnose knowledge base


def test_driver_libs_off_the_library_path_warn(ascend_host, capsys, monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{ascend_host.toolkit}/lib64")
    _, report = doctor(capsys, ascend_host)
    check = by_id(report)["driver_libs"]
    assert check["status"] == "WARN" and "export LD_LIBRARY_PATH=" in check["fix"]


def test_visible_devices_naming_a_missing_npu_fails(ascend_host, capsys, monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "6,7,8")
    code, report = doctor(capsys, ascend_host)
    check = by_id(report)["devices"]
    assert code == 1 and check["status"] == "FAIL" and "names 8" in check["reason"]


def test_tensor_parallel_larger_than_the_visible_npus_fails(ascend_host, capsys, monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1")
    code, report = doctor(capsys, ascend_host, "--tensor-parallel-size", "4")
    check = by_id(report)["devices"]
    assert code == 1 and "needs that many NPUs but 2 are visible" in check["reason"]


def test_unhealthy_npu_fails(ascend_host, capsys):
    ascend_host.set_npu_smi(npu_smi_table([Chip(), Chip(health="Alarm")]))
    code, report = doctor(capsys, ascend_host)
    assert code == 1 and "NPU 1 Alarm" in by_id(report)["devices"]["reason"]


def test_npu_smi_failure_is_reported(ascend_host, capsys):
    ascend_host.set_npu_smi("dcmi module initialize failed. ret is -8005\n", exit_code=1)
    code, report = doctor(capsys, ascend_host)
    check = by_id(report)["devices"]
    assert code == 1 and "dcmi module initialize failed" in check["reason"]
    assert "/dev/davinci_manager" in check["fix"]


def test_torch_npu_seeing_fewer_npus_than_npu_smi_warns(ascend_host, capsys):
    ascend_host.set_npu_smi(npu_smi_table([Chip()] * 4))
    _, report = doctor(capsys, ascend_host)
    check = by_id(report)["torch_npu_import"]
    assert check["status"] == "WARN" and "sees 8 NPUs but npu-smi shows 4" in check["reason"]


def test_research_sample_table_drives_the_busy_check(ascend_host, capsys):
    ascend_host.set_npu_smi((DATA / "npu-smi-910b2.txt").read_text())
    _, report = doctor(capsys, ascend_host)
    busy = by_id(report)["busy"]
    assert (
        busy["status"] == "WARN"
        and "NPU 1 (61258/65536 MB HBM; pid 30336 3790 MB)" in busy["reason"]
    )


@pytest.mark.parametrize(
    ("env", "status", "text"),
    [
        ({}, "PASS", "single-node tensor parallel"),
        ({"HCCL_IF_IP": "127.0.0.1"}, "PASS", "HCCL_IF_IP=127.0.0.1"),
        ({"HCCL_IF_IP": "192.0.2.77"}, "FAIL", "not an address of this host"),
        ({"HCCL_IF_IP": "eth0"}, "FAIL", "not an IP address"),
        ({"HCCL_SOCKET_IFNAME": "nosuchnic9"}, "FAIL", "matches no interface"),
        ({"GLOO_SOCKET_IFNAME": "lo"}, "PASS", "GLOO_SOCKET_IFNAME=lo"),
        ({"HCCL_CONNECT_TIMEOUT": "2min"}, "FAIL", "not a positive integer"),
    ],
)
def test_collective_settings_for_tensor_parallel(
    ascend_host, capsys, monkeypatch, env, status, text
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _, report = doctor(capsys, ascend_host, "--tensor-parallel-size", "2")
    check = by_id(report)["collective_env"]
    assert check["status"] == status and text in check["reason"]


def test_multi_node_run_requires_hccl_if_ip(ascend_host, capsys):
    code, report = doctor(capsys, ascend_host, "--multi-node", "-tp", "8")
    check = by_id(report)["collective_env"]
    assert code == 1 and check["status"] == "FAIL" and "HCCL_IF_IP" in check["fix"]


def test_platform_is_detected_from_the_ascend_root(ascend_host, capsys):
    _, report = run_doctor(capsys, "--ascend-root", str(ascend_host.root))
    assert report["platform"] == "npu"


def test_firmware_falls_back_to_npu_smi_board(ascend_host, capsys):
    (ascend_host.root / "firmware" / "version.info").unlink()
    _, report = doctor(capsys, ascend_host)
    assert by_id(report)["firmware"]["status"] == "SKIP"  # the table has no board lines
    ascend_host.set_npu_smi(npu_smi_table([Chip()] * 8), board=npu_smi_board("7.1.0.7.220"))
    _, report = doctor(capsys, ascend_host)
    check = by_id(report)["firmware"]
    assert check["status"] == "PASS" and "7.1.0.7.220 (from npu-smi info -t board)" in check[
        "reason"]  # fmt: skip


def test_firmware_the_device_calls_incompatible_warns(ascend_host, capsys):
    ascend_host.set_npu_smi(npu_smi_table([Chip()] * 8), board=npu_smi_board(compatibility="NOK"))
    code, report = doctor(capsys, ascend_host)
    check = by_id(report)["firmware"]
    assert check["status"] == "WARN" and "Compatibility NOK" in check["reason"]
    assert "HDK" in check["fix"] and code == 0
