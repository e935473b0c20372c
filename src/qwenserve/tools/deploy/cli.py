"""``qwenserve deploy TARGET [options] -- SERVE_FLAGS``: write production files for a server.

The serve flags after ``--`` are those of ``qwenserve serve`` and end up, unchanged and safely
quoted, in the generated start command, so what was tested by hand is what runs in production.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from qwenserve.tools.deploy.options import TARGETS, DeployOptions, add_options, build_options
from qwenserve.tools.deploy.spec import DeployError, parse_serve_args
from qwenserve.tools.deploy.targets_container import docker_files
from qwenserve.tools.deploy.targets_k8s import k8s_files
from qwenserve.tools.deploy.targets_lb import haproxy_files, nginx_files
from qwenserve.tools.deploy.targets_monitoring import grafana_files, prometheus_files
from qwenserve.tools.deploy.targets_service import GeneratedFile, supervisor_files, systemd_files

GENERATORS: dict[str, Callable[[DeployOptions], list[GeneratedFile]]] = {
    "systemd": systemd_files,
    "supervisor": supervisor_files,
    "nginx": nginx_files,
    "haproxy": haproxy_files,
    "prometheus": prometheus_files,
    "grafana": grafana_files,
    "docker": docker_files,
    "k8s": k8s_files,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=(*TARGETS, "all"), help="what to write")
    add_options(parser)
    parser.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        metavar="-- SERVE_FLAGS",
        help="the flags of `qwenserve serve`, after --",
    )


def apply_rest(args: argparse.Namespace) -> list[str]:
    """Options given after TARGET land in ``args.rest`` (argparse REMAINDER): parse them into
    ``args`` and return the serve flags. Everything after ``--`` belongs to serve, and deploy's
    options share no name with a serve flag, so without ``--`` the unknown tokens are serve's.
    """
    parser = argparse.ArgumentParser(prog="qwenserve deploy", add_help=False, allow_abbrev=False)
    add_options(parser)
    tokens = list(args.rest)
    if "--" in tokens:
        cut = tokens.index("--")
        parser.parse_args(tokens[:cut], namespace=args)
        return tokens[cut + 1 :]
    _, serve = parser.parse_known_args(tokens, namespace=args)
    return serve


def _platform(requested: str) -> str:
    if requested != "auto":
        return requested
    from qwenserve.tools.doctor.ascend import DEFAULT_ASCEND_ROOT
    from qwenserve.tools.doctor.context import detect_platform

    return detect_platform(Path(DEFAULT_ASCEND_ROOT))


def write_files(files: Sequence[GeneratedFile], directory: Path, force: bool) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    existing = [directory / f.name for f in files if (directory / f.name).exists()]
    if existing and not force:
        raise DeployError(f"{existing[0]} exists; pass --force to overwrite")
    written = []
    for f in files:
        path = directory / f.name
        _create_file(path, f.content, f.mode, replace=force)
        written.append(path)
    return written


def _create_file(path: Path, content: str, mode: int, replace: bool) -> None:
    """Create ``path`` with ``mode`` from the first byte (secrets are never readable by others,
    not even for a moment) and never through a symbolic link someone left there."""
    if path.is_symlink():
        raise DeployError(f"{path} is a symbolic link; remove it, qwenserve will not write through it")
    if replace and path.exists():
        path.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError as e:  # created between the check and here
        raise DeployError(f"{path} appeared while writing; run again") from e
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), mode)  # the umask may have taken bits away (0644 files)
        out.write(content)


def warnings(opts: DeployOptions, target: str) -> list[str]:
    notes = []
    container = target in ("docker", "k8s", "all")
    if container and opts.serve.host not in (None, "0.0.0.0", "::"):
        notes.append(f"--host {opts.serve.host}: in a container the server must listen on 0.0.0.0")
    if target in ("nginx", "haproxy", "prometheus") and not opts.backends:
        notes.append(f"no --backends given: using {opts.upstreams[0]}")
    return notes


def generate(opts: DeployOptions, target: str, output_dir: Path, force: bool) -> list[Path]:
    if target != "all":
        return write_files(GENERATORS[target](opts), output_dir, force)
    written: list[Path] = []
    for name, generator in GENERATORS.items():
        written += write_files(generator(opts), output_dir / name, force)
    return written


def run(args: argparse.Namespace) -> int:
    try:
        serve_argv = apply_rest(args)
        opts = build_options(args, parse_serve_args(serve_argv), _platform(args.platform))
        written = generate(opts, args.target, args.output_dir, args.force)
    except DeployError as e:
        print(f"qwenserve deploy: {e}", file=sys.stderr)
        return 2
    for note in warnings(opts, args.target):
        print(f"warning: {note}", file=sys.stderr)
    print(f"qwenserve deploy {args.target} (platform {opts.platform}) wrote:")
    for path in written:
        print(f"  {path}")
    return 0
