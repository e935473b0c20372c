"""deploy's command line: serve flags after --, options before or after the target, API keys."""

from __future__ import annotations

import sys

import pytest
from ops_helpers import run_deploy

from qwenserve.entrypoints.cli import main
from qwenserve.tools.deploy.cli import GENERATORS
from qwenserve.tools.deploy.options import TARGETS
from qwenserve.tools.deploy.spec import DeployError, parse_serve_args, split_api_keys

pytestmark = pytest.mark.usefixtures("clean_env")


def test_serve_flags_are_read_like_vllm_serve():
    argv = ["Qwen/Qwen3-8B", "--port", "8100", "--host", "0.0.0.0", "-tp", "4",
            "--served-model-name", "qwen3", "q3", "--max-model-len", "32768", "--enforce-eager"]  # fmt: skip
    spec = parse_serve_args(argv)
    assert (spec.model, spec.port, spec.host) == ("Qwen/Qwen3-8B", 8100, "0.0.0.0")
    assert spec.served_model_name == "qwen3" and spec.model_name == "qwen3"
    assert spec.num_devices == 4 and spec.api_key is None
    assert spec.argv == tuple(argv)


def test_flags_serve_would_refuse_are_refused_here(tmp_path, capsys):
    argv = ["deploy", "systemd", "--output-dir", str(tmp_path), "--", "Qwen/Qwen3-8B", "--bogus"]
    assert main(argv) == 2 and "do not parse" in capsys.readouterr().err


def test_model_flag_and_defaults():
    spec = parse_serve_args(["--max-model-len", "4096", "--model", "/models/q"])
    assert spec.model == "/models/q" and spec.port == 8000 and spec.model_name == "/models/q"


@pytest.mark.parametrize(
    "argv",
    [["M", "--api-key", "sk-1", "--port", "1"], ["M", "--api-key=sk-1", "--port", "1"]],
)
def test_api_key_is_taken_out_of_the_command(argv):
    spec = parse_serve_args(argv)
    assert spec.api_key == "sk-1" and spec.argv == ("M", "--port", "1")


def test_several_api_keys_stay_on_the_command_line():
    keys, rest = split_api_keys(["M", "--api-key", "a", "b", "--port", "1"])
    assert keys == ["a", "b"] and rest == ["M", "--port", "1"]
    spec = parse_serve_args(["M", "--api-key", "a", "b"])
    assert spec.api_key is None and spec.argv == ("M", "--api-key", "a", "b")


def test_options_may_come_before_or_after_the_target(tmp_path):
    files = run_deploy(tmp_path / "a", "haproxy", "--name", "llm", "--backends", "10.0.0.9:8000")
    assert "server server1 10.0.0.9:8000 check" in files["haproxy.cfg"].read_text()
    assert main(["deploy", "--name", "llm2", "haproxy", "--output-dir", str(tmp_path / "b")]) == 0
    assert "backend llm2" in (tmp_path / "b" / "haproxy.cfg").read_text()


def test_serve_flags_after_dashes_are_not_taken_as_deploy_options(tmp_path):
    files = run_deploy(
        tmp_path,
        "k8s",
        "--platform",
        "cpu",
        serve=["Qwen/Qwen3-0.6B", "--port", "9000", "--chat-template", "t.jinja"],
    )
    text = files["qwenserve.yaml"].read_text()
    assert "- '9000'" in text and "t.jinja" in text


def test_missing_serve_flags_are_an_error_with_an_example(tmp_path, capsys):
    assert main(["deploy", "systemd", "--platform", "cpu", "--output-dir", str(tmp_path)]) == 2
    assert "qwenserve deploy systemd -- Qwen/Qwen3-8B --port 8000" in capsys.readouterr().err


def test_existing_files_are_kept_unless_forced(tmp_path, capsys):
    run_deploy(tmp_path, "haproxy")
    assert main(["deploy", "haproxy", "--output-dir", str(tmp_path)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(["deploy", "haproxy", "--output-dir", str(tmp_path), "--force"]) == 0


@pytest.mark.parametrize(
    ("option", "value"),
    [("--backends", "10.0.0.1"), ("--listen", "80"), ("--name", "my service"),
     ("--sticky-header", "X Session"), ("--env", "NOEQUALS"), ("--devices", "a,b")],
)  # fmt: skip
def test_bad_options_are_rejected_with_a_message(tmp_path, capsys, option, value):
    code = main(["deploy", "nginx", "--output-dir", str(tmp_path), option, value, "--", "M"])
    assert code == 2 and option.split("-")[-1] in capsys.readouterr().err


def test_all_targets_at_once(tmp_path):
    run_deploy(tmp_path, "all", "--platform", "npu", serve=["Qwen/Qwen3-8B"])
    folders = {p.parent.name for p in tmp_path.rglob("*") if p.is_file()}
    assert folders == {
        "systemd",
        "supervisor",
        "nginx",
        "haproxy",
        "prometheus",
        "grafana",
        "docker",
        "k8s",
    }


def test_parse_error_type_and_every_target_has_a_generator():
    assert issubclass(DeployError, ValueError)
    assert tuple(GENERATORS) == TARGETS


def test_fallback_parser_reads_the_same_when_the_serve_parser_is_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "qwenserve.entrypoints.openai.cli_args", None)  # ImportError
    spec = parse_serve_args(["Qwen/Qwen3-8B", "--max-model-len", "4096", "-tp", "2", "--port", "81",
                             "--served-model-name", "a", "b", "--unknown-flag", "x"])  # fmt: skip
    assert (spec.model, spec.port, spec.tensor_parallel_size, spec.served_model_name) == (
        "Qwen/Qwen3-8B", 81, 2, "a")  # fmt: skip
    assert parse_serve_args(["--enforce-eager", "--model", "/m"]).model == "/m"
