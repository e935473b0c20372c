"""Shared pieces of the generated files: the start command, its environment, quoting, templates.

Templates (``templates/*.j2``) hold the formats with their own syntax (systemd, nginx, haproxy,
Dockerfile, shell); YAML and JSON outputs (Prometheus, Grafana, Kubernetes) are built as data and
dumped, so quoting can never break them.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

import jinja2

from qwenserve.tools.deploy.options import DeployOptions
from qwenserve.tools.deploy.spec import DeployError

# `exec "$0" "$@"` runs the real command as separate arguments after `bash -c SCRIPT`, so no
# serve flag is ever re-parsed by a shell.
_SOURCE_AND_EXEC = 'source {set_env} && exec "$0" "$@"'
_SYSTEMD_BARE = re.compile(r"[A-Za-z0-9_@+=:,./-]+")


def set_env_path(opts: DeployOptions) -> str:
    return f"{opts.ascend_root}/ascend-toolkit/set_env.sh"


def serve_command(opts: DeployOptions, executable: str | None = None) -> list[str]:
    return [executable or opts.qwenserve_bin, "serve", *opts.serve.argv]


def start_command(opts: DeployOptions, executable: str | None = None) -> list[str]:
    """The serve command; on Ascend wrapped so the CANN environment is sourced first."""
    command = serve_command(opts, executable)
    if opts.platform != "npu":
        return command
    return ["/bin/bash", "-c", _SOURCE_AND_EXEC.format(set_env=set_env_path(opts)), *command]


def environment(opts: DeployOptions, in_container: bool = False) -> list[tuple[str, str]]:
    """Variables the server needs; user ``--env`` entries come last and win."""
    pairs: list[tuple[str, str]] = []
    ids = ",".join(str(i) for i in opts.device_ids)
    if opts.platform == "npu":
        lib64 = f"{opts.ascend_root}/driver/lib64"
        pairs.append(("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True"))
        pairs.append(("LD_LIBRARY_PATH", f"{lib64}/driver:{lib64}/common"))
        if not in_container and opts.devices is not None:
            pairs.append(("ASCEND_RT_VISIBLE_DEVICES", ids))
    elif opts.platform == "cuda":
        pairs.append(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))
        if not in_container and opts.devices is not None:
            pairs.append(("CUDA_VISIBLE_DEVICES", ids))
    merged = dict(pairs)
    merged.update(opts.env)
    return list(merged.items())


def secrets(opts: DeployOptions) -> list[tuple[str, str]]:
    """The API key travels as VLLM_API_KEY (read by the server) instead of a visible flag."""
    return [("VLLM_API_KEY", opts.serve.api_key)] if opts.serve.api_key else []


def systemd_word(arg: str) -> str:
    """Quote one ExecStart argument: systemd expands ``$VAR`` and ``%x`` itself."""
    if "\n" in arg:
        raise DeployError(f"a serve argument contains a newline: {arg!r}")
    arg = arg.replace("%", "%%").replace("$", "$$")
    if _SYSTEMD_BARE.fullmatch(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_command(argv: Sequence[str]) -> str:
    return " ".join(systemd_word(a) for a in argv)


def supervisor_command(argv: Sequence[str]) -> str:
    """supervisord splits ``command`` with shlex and expands ``%(name)s``, so % is doubled."""
    return shlex.join(argv).replace("%", "%%")


def supervisor_environment(pairs: Sequence[tuple[str, str]]) -> str:
    for key, value in pairs:
        if '"' in value or "\n" in value:
            raise DeployError(f"{key}: supervisor values may not contain quotes or newlines")
    return ",".join(f'{key}="{value.replace("%", "%%")}"' for key, value in pairs)


def split_host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("qwenserve.tools.deploy", "templates"),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    autoescape=False,  # noqa: S701 - config files, not HTML
)


def render(template: str, **context: object) -> str:
    return _ENV.get_template(template).render(**context)
