"""Deploy options: argparse definitions and the frozen, validated value every target reads."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

from qwenserve import envs
from qwenserve.tools.deploy.spec import (
    DeployError,
    ServeSpec,
    check_host_port,
    check_name,
    check_path,
    parse_env,
)

TARGETS = ("systemd", "supervisor", "nginx", "haproxy", "prometheus", "grafana", "docker", "k8s")
PLATFORMS = ("auto", "npu", "cuda", "cpu")
DEFAULT_BASE_IMAGES = {
    "npu": "quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.12",
    "cuda": "python:3.12-slim",  # torch's CUDA wheels bring the CUDA runtime
    "cpu": "python:3.12-slim",
}


@dataclasses.dataclass(frozen=True)
class DeployOptions:
    """Everything the targets read. ``serve`` holds what was parsed from the serve flags."""

    serve: ServeSpec
    platform: str
    name: str = "qwenserve"
    user: str = "qwenserve"
    working_dir: str = "/var/lib/qwenserve"
    env_file: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    qwenserve_bin: str = "/usr/local/bin/qwenserve"
    ascend_root: str = "/usr/local/Ascend"
    devices: tuple[int, ...] | None = None
    backends: tuple[str, ...] = ()
    listen: str = "0.0.0.0:80"
    sticky_header: str | None = None
    sticky_cookie: str | None = None
    replicas: int = 1
    base_image: str | None = None
    image: str = "qwenserve:latest"
    namespace: str = "default"
    pip_spec: str = "qwenserve"
    log_file: str | None = None
    lb_dir: str | None = None
    scrape_interval: str = "15s"

    @property
    def device_ids(self) -> tuple[int, ...]:
        """Devices to use: ``--devices``, else the first TP x PP ones."""
        return self.devices if self.devices is not None else tuple(range(self.serve.num_devices))

    @property
    def upstreams(self) -> tuple[str, ...]:
        return self.backends or (f"127.0.0.1:{self.serve.port}",)

    @property
    def resolved_base_image(self) -> str:
        return self.base_image or DEFAULT_BASE_IMAGES[self.platform]


def add_options(parser: argparse.ArgumentParser) -> None:
    """Deploy's own options; none shares a name with a serve flag (see cli.split_rest)."""
    add = parser.add_argument
    add("--output-dir", type=Path, default=Path("deploy"), help="where to write (default ./deploy)")
    add("--force", action="store_true", help="overwrite files that exist")
    add(
        "--platform",
        choices=PLATFORMS,
        default="auto",
        help="target accelerator (default: this host's)",
    )
    add("--name", default="qwenserve", help="service / container / job name")
    add("--user", default="qwenserve", help="account the service runs as (systemd, supervisor)")
    add("--working-dir", default="/var/lib/qwenserve", help="the service's working directory")
    add("--env-file", default=None, help="extra environment file to load (systemd, docker)")
    add(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra variable (repeatable)",
    )
    add("--qwenserve-bin", default=None, help="path of the qwenserve executable on the target host")
    add("--ascend-root", default="/usr/local/Ascend", help="CANN / driver root on the target host")
    add("--devices", default=None, help="device ids to use, e.g. 0,1,2,3 (default: first TP x PP)")
    add("--backends", default=None, help="servers to balance or scrape: host:port,host:port")
    add("--listen", default="0.0.0.0:80", help="load balancer address (nginx, haproxy)")
    sticky = parser.add_mutually_exclusive_group()
    sticky.add_argument(
        "--sticky-header", default=None, help="pin a chat to a server by this header"
    )
    sticky.add_argument(
        "--sticky-cookie", default=None, help="pin a chat to a server by this cookie"
    )
    add("--lb-dir", default=None, help="nginx: folder for pid, temp files and logs")
    add("--replicas", type=int, default=1, help="k8s Deployment replicas")
    add("--base-image", default=None, help="docker base image (default: CANN 9.1.0 on Ascend)")
    add("--image", default="qwenserve:latest", help="image the k8s Deployment runs")
    add("--namespace", default="default", help="k8s namespace")
    add("--pip-spec", default="qwenserve", help="what the Dockerfile pip-installs (name or .whl)")
    add("--log-file", default=None, help="systemd: log to this file (with logrotate) not journald")
    add("--scrape-interval", default="15s", help="prometheus scrape interval")


def _devices(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    entries = [e.strip() for e in value.split(",") if e.strip()]
    if not entries or not all(e.isdigit() for e in entries):
        raise DeployError(f"--devices {value!r} must be a list of ids such as 0,1,2,3")
    return tuple(int(e) for e in entries)


def _default_bin() -> str:
    return shutil.which("qwenserve", path=envs.get("PATH")) or "/usr/local/bin/qwenserve"


def _header(value: str | None) -> str | None:
    if value is not None and not value.replace("-", "").isalnum():
        raise DeployError(f"--sticky-header {value!r} must be a header name such as X-Session-ID")
    return value


def _cookie(value: str | None) -> str | None:
    if value is not None and not value.replace("_", "").isalnum():
        raise DeployError(f"--sticky-cookie {value!r} must be letters, digits and '_'")
    return value


def build_options(args: argparse.Namespace, serve: ServeSpec, platform: str) -> DeployOptions:
    backends = [b for b in (args.backends or "").split(",") if b.strip()]
    if args.replicas < 1:
        raise DeployError("--replicas must be at least 1")
    if args.sticky_header and args.sticky_cookie:
        raise DeployError("give --sticky-header or --sticky-cookie, not both")
    return DeployOptions(
        serve=serve,
        platform=platform,
        name=check_name(args.name, "--name"),
        user=check_name(args.user, "--user"),
        working_dir=check_path(args.working_dir, "--working-dir"),
        env_file=check_path(args.env_file, "--env-file") if args.env_file else None,
        env=parse_env(args.env),
        qwenserve_bin=check_path(args.qwenserve_bin or _default_bin(), "--qwenserve-bin"),
        ascend_root=check_path(args.ascend_root, "--ascend-root"),
        devices=_devices(args.devices),
        backends=tuple(check_host_port(b, "--backends entry") for b in backends),
        listen=check_host_port(args.listen, "--listen"),
        sticky_header=_header(args.sticky_header),
        sticky_cookie=_cookie(args.sticky_cookie),
        replicas=args.replicas,
        base_image=args.base_image,
        image=args.image,
        namespace=check_name(args.namespace, "--namespace"),
        pip_spec=args.pip_spec,
        log_file=check_path(args.log_file, "--log-file") if args.log_file else None,
        lb_dir=check_path(args.lb_dir, "--lb-dir") if args.lb_dir else None,
        scrape_interval=args.scrape_interval,
    )
