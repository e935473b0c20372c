"""Containers: a Dockerfile (+ a run script with the Ascend device and driver mounts) and k8s.

Inside the image CANN lives at /usr/local/Ascend whatever ``--ascend-root`` says about the host;
the host's driver is mounted in, as vllm-ascend's installation guide does.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex

from qwenserve.tools.deploy import render as r
from qwenserve.tools.deploy.options import DeployOptions
from qwenserve.tools.deploy.targets_service import GeneratedFile, require_model, secrets_file
from qwenserve.tools.doctor import compat

CONTAINER_ASCEND_ROOT = "/usr/local/Ascend"
_ASCEND_DEVICES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")


def in_container(opts: DeployOptions) -> DeployOptions:
    return dataclasses.replace(opts, ascend_root=CONTAINER_ASCEND_ROOT)


def ascend_host_mounts(opts: DeployOptions) -> list[tuple[str, str]]:
    """(host path, container path): driver libraries, version file, npu-smi and its dcmi."""
    host, inner = opts.ascend_root, CONTAINER_ASCEND_ROOT
    return [
        ("/usr/local/dcmi", "/usr/local/dcmi"),
        ("/usr/local/bin/npu-smi", "/usr/local/bin/npu-smi"),
        (f"{host}/driver/lib64/", f"{inner}/driver/lib64/"),
        (f"{host}/driver/version.info", f"{inner}/driver/version.info"),
        ("/etc/ascend_install.info", "/etc/ascend_install.info"),
    ]


def torch_pair(base_image: str) -> tuple[compat.CompatRow, str]:
    """The torch/torch_npu row for the CANN in the image tag (``cann:9.1.0-910b-...``)."""
    match = re.search(r"cann[:-](\d+\.\d+\.(?:\d+|RC\d+))", base_image, re.IGNORECASE)
    row = compat.newest_row_for_cann(match.group(1)) if match else None
    if row is not None:
        return row, f"CANN {row.cann} pairs with torch {row.torch} / torch_npu {row.torch_npu}."
    fallback = compat.RECOMMENDED
    return fallback, (
        f"no known CANN version in {base_image!r}; pinned the newest tested row "
        f"(CANN {fallback.cann}); change both if your image carries another CANN."
    )


def _docker_env_value(key: str, value: str) -> str:
    """Double-quoted, ``$`` escaped; LD_LIBRARY_PATH keeps what the base image set."""
    quoted = value.replace("$", "\\$")
    if key == "LD_LIBRARY_PATH":
        quoted += ":${LD_LIBRARY_PATH}"
    return f'"{quoted}"'


def dockerfile(opts: DeployOptions) -> str:
    inner = in_container(opts)
    row, note = torch_pair(opts.resolved_base_image)
    wheel = opts.pip_spec.rsplit("/", 1)[-1] if opts.pip_spec.endswith(".whl") else None
    return r.render(
        "Dockerfile.j2",
        name=opts.name,
        image=opts.image,
        base_image=opts.resolved_base_image,
        environment=[
            (k, _docker_env_value(k, v)) for k, v in r.environment(inner, in_container=True)
        ],
        platform=opts.platform,
        pair_note=note,
        torch=row.torch,
        torch_npu=row.torch_npu,
        wheel=wheel,
        pip_spec=opts.pip_spec,
        port=opts.serve.port,
        set_env=r.set_env_path(inner),
        cmd_json=json.dumps(r.serve_command(opts, executable="qwenserve")),
    )


def _run_flags(opts: DeployOptions, secret: GeneratedFile | None) -> list[str]:
    q = shlex.quote
    flags = ["-d", "--restart unless-stopped", f"-p {opts.serve.port}:{opts.serve.port}"]
    if opts.platform == "npu":
        flags += [f"--device /dev/davinci{i}" for i in opts.device_ids]
        flags += [f"--device {d}" for d in _ASCEND_DEVICES]
        flags += [f"-v {q(h)}:{q(c)}" for h, c in ascend_host_mounts(opts)]
        flags.append("--shm-size 16g")
    elif opts.platform == "cuda":
        device_list = ",".join(str(i) for i in opts.device_ids)
        flags.append(f"--gpus '\"device={device_list}\"'")
        flags.append("--ipc=host")
    else:
        flags.append("--shm-size 8g")
    model = opts.serve.model or ""
    if model.startswith("/"):
        flags.append(f"-v {q(model)}:{q(model)}:ro")
    flags.append('-v "$HOME/.cache/huggingface:/root/.cache/huggingface"')
    if secret:
        flags.append(f'--env-file "$HERE/{secret.name}"')
    if opts.env_file:
        flags.append(f"--env-file {q(opts.env_file)}")
    return flags


def docker_files(opts: DeployOptions) -> list[GeneratedFile]:
    require_model(opts, "docker")
    secret = secrets_file(opts)
    script = r.render(
        "docker-run.sh.j2",
        name=opts.name,
        image=opts.image,
        platform=opts.platform,
        device_ids=[str(i) for i in opts.device_ids],
        run_flags=_run_flags(opts, secret),
    )
    files = [
        GeneratedFile("Dockerfile", dockerfile(opts)),
        GeneratedFile("docker-run.sh", script, 0o755),
    ]
    return files + ([secret] if secret else [])
