"""deploy writes files holding the API key with mode 0600 from creation, never through a
symbolic link left in the output folder (issue 13)."""

from __future__ import annotations

import os
import stat

import pytest
from ops_helpers import run_deploy

from qwenserve.entrypoints.cli import main

pytestmark = pytest.mark.usefixtures("clean_env")
SERVE = ["Qwen/Qwen3-8B", "--api-key", "sk-secret"]


def test_secret_files_are_created_0600(tmp_path, monkeypatch):
    created: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *args, **kwargs):
        created.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    files = run_deploy(tmp_path, "systemd", serve=SERVE)
    env = files["qwenserve.env"]
    assert "sk-secret" in env.read_text()
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    flags, mode = next((f, m) for p, f, m in created if p == str(env))
    assert flags & os.O_EXCL and flags & os.O_NOFOLLOW and mode == 0o600


@pytest.mark.parametrize("force", [False, True])
def test_a_symlink_in_the_output_folder_is_refused(tmp_path, capsys, force):
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "elsewhere.txt"  # dangling: the attacker's file does not exist yet
    (out / "qwenserve.env").symlink_to(target)
    argv = ["deploy", "systemd", "--output-dir", str(out), *(["--force"] if force else [])]
    assert main([*argv, "--", *SERVE]) == 2
    assert not target.exists()
    err = capsys.readouterr().err
    assert "symbolic link" in err or "pass --force" in err
