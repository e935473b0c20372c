"""systemd and supervisord files, validated by systemd-analyze, supervisor's own parser and
logrotate, and run for real: the generated start command must reach qwenserve with the exact
serve flags, after sourcing CANN's set_env.sh on Ascend."""

from __future__ import annotations

import configparser
import getpass
import json
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
from ops_helpers import fake_ascend_root, fake_qwenserve, require_tool, run_command, run_deploy

pytestmark = pytest.mark.usefixtures("clean_env")

TRICKY = ["Qwen/Qwen3-8B", "--port", "8123", "--tensor-parallel-size", "2",
          "--default-chat-template-kwargs", '{"enable_thinking": false}',
          "--chat-template", "/srv/chat templates/it's.jinja", "--served-model-name", "qwen-100%",
          "--override-generation-config", '{"stop": ["$END"]}']  # fmt: skip


def systemd_verify(unit: Path) -> subprocess.CompletedProcess[str]:
    tool = require_tool("systemd-analyze", "systemd")
    return subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)


def exec_start_argv(unit_text: str) -> list[str]:
    """ExecStart as systemd splits it: quotes and C escapes like a shell, then $$ -> $, %% -> %."""
    line = next(line for line in unit_text.splitlines() if line.startswith("ExecStart="))
    words = shlex.split(line.removeprefix("ExecStart="))
    return [w.replace("$$", "$").replace("%%", "%") for w in words]


@pytest.fixture
def host_files(tmp_path: Path) -> tuple[Path, Path]:
    return fake_qwenserve(tmp_path / "bin"), fake_ascend_root(tmp_path / "Ascend")


# ids avoid the bare words cuda/npu, which the root conftest treats as device markers
@pytest.mark.parametrize("platform", ["npu", "cuda", "cpu"], ids=lambda p: f"platform-{p}")
def test_systemd_unit_verifies_and_runs_the_exact_serve_flags(tmp_path, host_files, platform):
    qwenserve, root = host_files
    files = run_deploy(tmp_path / "out", "systemd", "--platform", platform, "--qwenserve-bin",
                       str(qwenserve), "--ascend-root", str(root), serve=TRICKY)  # fmt: skip
    result = systemd_verify(files["qwenserve.service"])
    assert result.returncode == 0 and result.stderr == "", result.stderr
    ran = run_command(exec_start_argv(files["qwenserve.service"].read_text()))
    assert ran["argv"] == ["serve", *TRICKY]
    assert ran["sourced"] == ("1" if platform == "npu" else None)


def test_systemd_verify_catches_a_missing_executable(tmp_path):
    """The check above can fail: a unit whose ExecStart does not exist is rejected."""
    files = run_deploy(tmp_path, "systemd", "--platform", "cpu", "--qwenserve-bin",
                       str(tmp_path / "no" / "qwenserve"), serve=["Qwen/Qwen3-8B"])  # fmt: skip
    result = systemd_verify(files["qwenserve.service"])
    assert result.returncode != 0 and "qwenserve" in result.stderr


def test_systemd_unit_contents(tmp_path, host_files):
    qwenserve, root = host_files
    files = run_deploy(tmp_path, "systemd", "--platform", "npu", "--qwenserve-bin", str(qwenserve),
                       "--ascend-root", str(root), "--devices", "4,5", "--env", "HCCL_OP_EXPANSION_MODE=AIV",
                       "--env-file", "/etc/default/qwenserve", "--user", "llm",
                       serve=["Qwen/Qwen3-8B", "-tp", "2", "--api-key", "sk-secret"])  # fmt: skip
    unit = files["qwenserve.service"].read_text()
    assert "Restart=on-failure" in unit and "User=llm" in unit
    assert 'Environment="ASCEND_RT_VISIBLE_DEVICES=4,5"' in unit
    assert 'Environment="HCCL_OP_EXPANSION_MODE=AIV"' in unit
    assert "EnvironmentFile=-/etc/default/qwenserve" in unit
    assert "LogRateLimitBurst=" in unit and "SyslogIdentifier=qwenserve" in unit
    assert "sk-secret" not in unit and "EnvironmentFile=/etc/qwenserve/qwenserve.env" in unit
    secret = files["qwenserve.env"]
    assert "VLLM_API_KEY=sk-secret" in secret.read_text()
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    journald = configparser.ConfigParser()
    journald.read_string(files["journald-qwenserve.conf"].read_text())
    assert journald["Journal"]["SystemMaxUse"]


def test_log_file_mode_writes_a_logrotate_config_that_logrotate_accepts(tmp_path, host_files):
    logrotate = require_tool("logrotate", "logrotate")
    qwenserve, _ = host_files
    log = tmp_path / "logs" / "qwenserve.log"
    log.parent.mkdir()
    log.write_text("INFO started\n")
    files = run_deploy(tmp_path / "out", "systemd", "--platform", "cpu", "--qwenserve-bin",
                       str(qwenserve), "--log-file", str(log), serve=["Qwen/Qwen3-8B"])  # fmt: skip
    unit = files["qwenserve.service"].read_text()
    assert f"StandardOutput=append:{log}" in unit
    assert systemd_verify(files["qwenserve.service"]).returncode == 0
    state, conf = str(tmp_path / "state"), str(files["qwenserve.logrotate"])
    checked = subprocess.run([logrotate, "--debug", "--state", state, conf],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0 and not re.search(r"^error:", checked.stderr, re.M), (
        checked.stderr
    )
    rotated = subprocess.run([logrotate, "--force", "--state", state, conf],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert rotated.returncode == 0, rotated.stderr
    assert (
        log.read_text() == "" and (log.parent / "qwenserve.log.1").read_text() == "INFO started\n"
    )


def supervisor_python() -> str:
    """The interpreter of Debian's supervisord (its shebang): the parser we validate with."""
    script = Path(require_tool("supervisord", "supervisor"))
    return script.read_text().splitlines()[0].removeprefix("#!").split()[0]


def load_with_supervisor(conf: Path, tmp_path: Path) -> dict:
    main_conf = tmp_path / "supervisord.conf"
    main_conf.write_text(f"[supervisord]\nlogfile={tmp_path}/supervisord.log\n"
                         f"pidfile={tmp_path}/supervisord.pid\n[include]\nfiles = {conf}\n")  # fmt: skip
    code = (
        "import json, sys\nfrom supervisor.options import ServerOptions\n"
        "o = ServerOptions(); o.realize(['-c', sys.argv[1]])\n"
        "p = o.process_group_configs[0].process_configs[0]\n"
        "print(json.dumps({'name': p.name, 'command': p.command, 'environment': p.environment,"
        " 'stopsignal': int(p.stopsignal), 'autorestart': str(p.autorestart)}))"
    )
    done = subprocess.run([supervisor_python(), "-c", code, str(main_conf)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_supervisor_config_parses_and_runs_the_exact_serve_flags(tmp_path, host_files):
    qwenserve, root = host_files
    files = run_deploy(tmp_path / "out", "supervisor", "--platform", "npu", "--user",
                       getpass.getuser(), "--qwenserve-bin", str(qwenserve), "--ascend-root", str(root),
                       "--log-file", str(tmp_path / "qwenserve.log"),
                       serve=[*TRICKY, "--api-key", "sk-1%2"])  # fmt: skip
    program = load_with_supervisor(files["qwenserve.conf"], tmp_path)
    assert program["name"] == "qwenserve" and program["stopsignal"] == 15
    assert program["environment"]["VLLM_API_KEY"] == "sk-1%2"
    assert program["environment"]["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    ran = run_command(shlex.split(program["command"]))
    assert ran == {"argv": ["serve", *TRICKY], "sourced": "1"}
    assert stat.S_IMODE(files["qwenserve.conf"].stat().st_mode) == 0o600


def test_supervisor_rejects_an_unknown_user(tmp_path, host_files):
    """Supervisor's parser really validates: a user that does not exist is an error."""
    files = run_deploy(tmp_path / "out", "supervisor", "--platform", "cpu", "--user",
                       "no-such-user-qs", "--log-file", str(tmp_path / "q.log"), serve=["M"])  # fmt: skip
    main_conf = tmp_path / "s.conf"
    main_conf.write_text(f"[supervisord]\n[include]\nfiles = {files['qwenserve.conf']}\n")
    code = "import sys\nfrom supervisor.options import ServerOptions\nServerOptions().realize(['-c', sys.argv[1]])"
    done = subprocess.run(
        [supervisor_python(), "-c", code, str(main_conf)], capture_output=True, text=True
    )
    assert done.returncode != 0 and "no-such-user-qs" in done.stdout + done.stderr
