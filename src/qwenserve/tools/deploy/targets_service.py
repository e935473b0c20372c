"""Process managers: a systemd unit (journald or a log file with logrotate) and supervisord."""

from __future__ import annotations

import dataclasses

from qwenserve.tools.deploy import render as r
from qwenserve.tools.deploy.options import DeployOptions
from qwenserve.tools.deploy.spec import DeployError


@dataclasses.dataclass(frozen=True)
class GeneratedFile:
    """One output file; ``mode`` 0o600 for files that hold the API key."""

    name: str
    content: str
    mode: int = 0o644


def require_model(opts: DeployOptions, target: str) -> None:
    if not opts.serve.model:
        raise DeployError(
            f"deploy {target} needs the serve flags after --, e.g. "
            f"qwenserve deploy {target} -- Qwen/Qwen3-8B --port 8000"
        )


def secrets_file(opts: DeployOptions) -> GeneratedFile | None:
    pairs = r.secrets(opts)
    if not pairs:
        return None
    body = "".join(f"{key}={value}\n" for key, value in pairs)
    return GeneratedFile(
        f"{opts.name}.env", f"# secrets for {opts.name}; keep mode 0600\n{body}", 0o600
    )


def systemd_files(opts: DeployOptions) -> list[GeneratedFile]:
    require_model(opts, "systemd")
    secret = secrets_file(opts)
    unit = r.render(
        "systemd.service.j2",
        name=opts.name,
        model_name=opts.serve.model_name,
        user=opts.user,
        working_dir=opts.working_dir,
        environment=[(k, v.replace("%", "%%")) for k, v in r.environment(opts)],
        secrets_file=f"/etc/{opts.name}/{secret.name}" if secret else None,
        env_file=opts.env_file,
        platform=opts.platform,
        set_env=r.set_env_path(opts),
        exec_start=r.systemd_command(r.start_command(opts)),
        log_file=opts.log_file,
    )
    files = [GeneratedFile(f"{opts.name}.service", unit)]
    files.append(
        GeneratedFile(f"journald-{opts.name}.conf", r.render("journald.conf.j2", name=opts.name))
    )
    if opts.log_file:
        files.append(logrotate_file(opts, opts.log_file))
    if secret:
        files.append(secret)
    return files


def logrotate_file(opts: DeployOptions, log_file: str) -> GeneratedFile:
    content = r.render("logrotate.j2", name=opts.name, log_file=log_file)
    return GeneratedFile(f"{opts.name}.logrotate", content)


def supervisor_files(opts: DeployOptions) -> list[GeneratedFile]:
    require_model(opts, "supervisor")
    conf = r.render(
        "supervisor.conf.j2",
        name=opts.name,
        command=r.supervisor_command(r.start_command(opts)),
        working_dir=opts.working_dir,
        user=opts.user,
        environment=r.supervisor_environment(r.environment(opts) + r.secrets(opts)),
        log_file=opts.log_file or f"/var/log/supervisor/{opts.name}.log",
    )
    # The API key sits in this file's environment= line, so only its owner may read it.
    return [GeneratedFile(f"{opts.name}.conf", conf, 0o600 if opts.serve.api_key else 0o644)]
