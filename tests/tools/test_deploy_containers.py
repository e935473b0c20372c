"""Dockerfile + run script (bash -n, shellcheck, run against a fake docker) and k8s manifests."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from ops_helpers import require_tool, run_deploy, write_executable

pytestmark = pytest.mark.usefixtures("clean_env")

SERVE = ["Qwen/Qwen3-8B", "--port", "8100", "-tp", "2", "--api-key", "sk-secret",
         "--default-chat-template-kwargs", '{"enable_thinking": false}']  # fmt: skip
EXPECTED_CMD = ["qwenserve", "serve", "Qwen/Qwen3-8B", "--port", "8100", "-tp", "2",
                "--default-chat-template-kwargs", '{"enable_thinking": false}']  # fmt: skip


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", dockerfile)
    lines = [
        line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")
    ]
    return [(line.split(None, 1)[0], line.split(None, 1)[1]) for line in lines]


def test_ascend_dockerfile(tmp_path):
    files = run_deploy(tmp_path, "docker", "--platform", "npu", serve=SERVE)
    text = files["Dockerfile"].read_text()
    steps = instructions(text)
    assert steps[0] == ("ARG", "BASE_IMAGE=quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.12")
    assert steps[1] == ("FROM", "${BASE_IMAGE}")
    assert "pip install torch==2.10.0 torch_npu==2.10.0.post4" in text
    entrypoint = json.loads(dict(steps)["ENTRYPOINT"])
    assert entrypoint[:2] == ["/bin/bash", "-c"] and "ascend-toolkit/set_env.sh" in entrypoint[2]
    assert json.loads(dict(steps)["CMD"]) == EXPECTED_CMD
    assert "HEALTHCHECK" in dict(steps) and "/health" in dict(steps)["HEALTHCHECK"]
    assert "sk-secret" not in text


def test_base_image_cann_picks_the_torch_pair(tmp_path):
    files = run_deploy(tmp_path, "docker", "--platform", "npu", "--base-image",
                       "quay.io/ascend/cann:8.5.1-910b-ubuntu22.04-py3.11", serve=["M"])  # fmt: skip
    assert "pip install torch==2.9.0 torch_npu==2.9.0 " in files["Dockerfile"].read_text()


def test_unknown_base_image_falls_back_to_the_newest_pair_and_says_so(tmp_path):
    files = run_deploy(tmp_path, "docker", "--platform", "npu", "--base-image", "myorg/npu:latest",
                       serve=["M"])  # fmt: skip
    text = files["Dockerfile"].read_text()
    assert (
        "no known CANN version in 'myorg/npu:latest'" in text and "torch_npu==2.10.0.post4" in text
    )


@pytest.mark.parametrize(("platform", "index"), [("cuda", "pip install torch\n"), ("cpu", "whl/cpu")],
                         ids=["platform-cuda", "platform-cpu"])  # fmt: skip
def test_cuda_and_cpu_dockerfiles(tmp_path, platform, index):
    files = run_deploy(tmp_path, "docker", "--platform", platform, "--pip-spec", "dist/qwenserve-0.1.0-py3-none-any.whl",
                       serve=["Qwen/Qwen3-0.6B"])  # fmt: skip
    text = files["Dockerfile"].read_text()
    assert "FROM ${BASE_IMAGE}" in text and index in text and "ENTRYPOINT" not in text
    assert "COPY qwenserve-0.1.0-py3-none-any.whl /tmp/" in text


def run_script_with_fake_docker(script: Path, tmp_path: Path) -> list[str]:
    bin_dir = tmp_path / "fakebin"
    write_executable(bin_dir / "docker", '#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": "/home/op"}
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env=env, timeout=30, check=True
    )
    return done.stdout.splitlines()


def test_ascend_run_script_maps_devices_and_driver(tmp_path):
    files = run_deploy(tmp_path, "docker", "--platform", "npu", "--devices", "4,5", serve=SERVE)
    script = files["docker-run.sh"]
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    args = run_script_with_fake_docker(script, tmp_path)
    joined = " ".join(args)
    for device in (
        "/dev/davinci4",
        "/dev/davinci5",
        "/dev/davinci_manager",
        "/dev/devmm_svm",
        "/dev/hisi_hdc",
    ):
        assert f"--device {device}" in joined
    assert "/dev/davinci0" not in joined
    for mount in (
        "/usr/local/Ascend/driver/lib64/:/usr/local/Ascend/driver/lib64/",
        "/usr/local/Ascend/driver/version.info:/usr/local/Ascend/driver/version.info",
        "/usr/local/bin/npu-smi:/usr/local/bin/npu-smi",
        "/usr/local/dcmi:/usr/local/dcmi",
    ):
        assert f"-v {mount}" in joined
    assert (
        "-p 8100:8100" in joined
        and "/home/op/.cache/huggingface:/root/.cache/huggingface" in joined
    )
    assert f"--env-file {tmp_path}/qwenserve.env" in joined and args[-1] == "qwenserve:latest"
    assert (tmp_path / "qwenserve.env").read_text().endswith("VLLM_API_KEY=sk-secret\n")


def test_cuda_run_script_asks_for_the_gpus(tmp_path):
    files = run_deploy(
        tmp_path, "docker", "--platform", "cuda", serve=["/models/Qwen3-8B", "-tp", "2"]
    )
    args = run_script_with_fake_docker(files["docker-run.sh"], tmp_path)
    assert args[args.index("--gpus") + 1] == '"device=0,1"' and "--ipc=host" in args
    assert "/models/Qwen3-8B:/models/Qwen3-8B:ro" in args


@pytest.mark.parametrize("platform", ["npu", "cuda", "cpu"], ids=lambda p: f"platform-{p}")
def test_run_script_passes_shellcheck(tmp_path, platform):
    shellcheck = require_tool("shellcheck", "shellcheck")
    files = run_deploy(tmp_path, "docker", "--platform", platform, serve=SERVE)
    result = subprocess.run(
        [shellcheck, str(files["docker-run.sh"])], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


def load_manifests(tmp_path: Path, *options: str, serve: list[str]) -> dict[str, dict]:
    files = run_deploy(tmp_path, "k8s", *options, serve=serve)
    return {doc["kind"]: doc for doc in yaml.safe_load_all(files["qwenserve.yaml"].read_text())}


def test_k8s_ascend_deployment(tmp_path):
    docs = load_manifests(
        tmp_path, "--platform", "npu", "--replicas", "3", "--namespace", "llm", serve=SERVE
    )
    deployment, service, secret = docs["Deployment"], docs["Service"], docs["Secret"]
    spec = deployment["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"] == labels == service["spec"]["selector"]
    assert spec["replicas"] == 3 and deployment["metadata"]["namespace"] == "llm"
    container = spec["template"]["spec"]["containers"][0]
    assert (
        container["command"][:2] == ["/bin/bash", "-c"] and container["command"][3:] == EXPECTED_CMD
    )
    assert container["resources"]["limits"] == {"huawei.com/Ascend910": "2"}
    assert container["ports"] == [{"name": "http", "containerPort": 8100}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": 8100}
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    key_ref = next(e for e in container["env"] if e["name"] == "VLLM_API_KEY")["valueFrom"][
        "secretKeyRef"
    ]
    assert (
        key_ref["name"] == secret["metadata"]["name"]
        and secret["stringData"]["VLLM_API_KEY"] == "sk-secret"
    )
    volumes = {v["name"] for v in spec["template"]["spec"]["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} == volumes
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/usr/local/Ascend/driver/lib64", "/dev/shm", "/usr/local/bin/npu-smi"} <= mounts
    assert "&id" not in (tmp_path / "qwenserve.yaml").read_text()


def test_k8s_cuda_and_cpu(tmp_path):
    cuda = load_manifests(tmp_path / "a", "--platform", "cuda", serve=["/models/q", "-tp", "4"])
    container = cuda["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert {"name": "model", "mountPath": "/models/q", "readOnly": True} in container[
        "volumeMounts"
    ]
    cpu = load_manifests(tmp_path / "b", "--platform", "cpu", serve=["Qwen/Qwen3-0.6B"])
    container = cpu["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {} and container["command"][:2] == ["qwenserve", "serve"]
    assert "Secret" not in cpu
