"""Load balancers across several servers: nginx and HAProxy.

Both use least connections (a long generation holds its connection, so open connections are the
best cheap measure of load) and optional stickiness on a header or cookie, which keeps a multi-turn
chat on the server whose prefix cache already holds it.
"""

from __future__ import annotations

import re

from qwenserve.tools.deploy import render as r
from qwenserve.tools.deploy.options import DeployOptions
from qwenserve.tools.deploy.targets_service import GeneratedFile


def _variable_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def _nginx_sticky(opts: DeployOptions) -> tuple[str | None, str | None]:
    """(nginx variable, description) of the stickiness key, or (None, None)."""
    if opts.sticky_header:
        return "$http_" + opts.sticky_header.lower().replace(
            "-", "_"
        ), f"the {opts.sticky_header} header"
    if opts.sticky_cookie:
        return f"$cookie_{opts.sticky_cookie}", f"the {opts.sticky_cookie} cookie"
    return None, None


def _lb_paths(opts: DeployOptions) -> dict[str, str]:
    """nginx creates only the last folder of a temp path, so every parent must already exist:
    Debian's /var/lib/nginx and /var/log/nginx by default, or the folder given by --lb-dir."""
    if opts.lb_dir:
        base = opts.lb_dir.rstrip("/")
        return {
            "pid_file": f"{base}/nginx.pid",
            "temp_prefix": f"{base}/",
            "error_log": f"{base}/error.log",
            "access_log": f"{base}/access.log",
        }
    return {
        "pid_file": f"/run/nginx-{opts.name}.pid",
        "temp_prefix": f"/var/lib/nginx/{opts.name}-",
        "error_log": f"/var/log/nginx/{opts.name}-error.log",
        "access_log": f"/var/log/nginx/{opts.name}-access.log",
    }


def nginx_files(opts: DeployOptions) -> list[GeneratedFile]:
    sticky_variable, sticky_source = _nginx_sticky(opts)
    site = r.render(
        "nginx-site.conf.j2",
        name=opts.name,
        name_var=_variable_name(opts.name),
        servers=opts.upstreams,
        listen=opts.listen,
        sticky_variable=sticky_variable,
        sticky_source=sticky_source,
    )
    main = r.render("nginx.conf.j2", name=opts.name, **_lb_paths(opts))
    return [GeneratedFile(f"{opts.name}.conf", site), GeneratedFile("nginx.conf", main)]


def haproxy_files(opts: DeployOptions) -> list[GeneratedFile]:
    if opts.sticky_header:
        fetch, source = f"req.hdr({opts.sticky_header})", f"the {opts.sticky_header} header"
    elif opts.sticky_cookie:
        fetch, source = f"req.cook({opts.sticky_cookie})", f"the {opts.sticky_cookie} cookie"
    else:
        fetch, source = None, None
    servers = [(f"server{i + 1}", server) for i, server in enumerate(opts.upstreams)]
    config = r.render(
        "haproxy.cfg.j2",
        name=opts.name,
        listen=opts.listen,
        servers=servers,
        sticky_fetch=fetch,
        sticky_source=source,
    )
    return [GeneratedFile("haproxy.cfg", config)]
