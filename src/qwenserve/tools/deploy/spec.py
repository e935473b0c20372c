"""What ``deploy`` needs from the ``serve`` flags, and checks on the deploy options.

The serve flags come after ``--`` exactly as they would be given to ``qwenserve serve``. They are
read with the server's own parser when it exists (``make_serve_parser``), otherwise with a small
parser that knows only the flags deploy uses; either way the flags are passed on unchanged, except
``--api-key``, which moves into an environment file or secret so it does not show in ``ps`` or in a
world-readable unit file.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence


class DeployError(ValueError):
    """A bad deploy option or serve flag; the message says which and what to write instead."""


@dataclasses.dataclass(frozen=True)
class ServeSpec:
    argv: tuple[str, ...]  # the serve flags to run, without the API key
    model: str | None
    host: str | None
    port: int
    served_model_name: str | None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    api_key: str | None = None

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def model_name(self) -> str:
        """The ``model_name`` label the server puts on its metrics."""
        return self.served_model_name or self.model or "unknown"


def split_api_keys(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(keys, the other flags): ``--api-key K [K ...]`` and ``--api-key=K`` are taken out."""
    keys: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--api-key="):
            keys.append(token.split("=", 1)[1])
        elif token == "--api-key":
            i += 1
            while i < len(argv) and not argv[i].startswith("-"):
                keys.append(argv[i])
                i += 1
            continue
        else:
            rest.append(token)
        i += 1
    return keys, rest


def _fallback_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwenserve serve", add_help=False, allow_abbrev=False)
    parser.add_argument("--model")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    return parser


def _parse(argv: list[str]) -> argparse.Namespace:
    """The server's parser when it exists (it validates every flag), else the fallback."""
    try:
        from qwenserve.entrypoints.openai.cli_args import make_serve_parser
    except ImportError:
        # `vllm serve MODEL [flags]`: the model comes first; the fallback knows no other flags,
        # so it cannot tell a positional from the value of an unknown flag anywhere else.
        model_tag = argv[0] if argv and not argv[0].startswith("-") else None
        namespace, _unknown = _fallback_parser().parse_known_args(argv[1:] if model_tag else argv)
        namespace.model_tag = model_tag
        return namespace
    try:
        return make_serve_parser().parse_args(argv)
    except SystemExit as e:
        raise DeployError(f"the serve flags after -- do not parse: {' '.join(argv)}") from e


def parse_serve_args(argv: Sequence[str]) -> ServeSpec:
    keys, rest = split_api_keys(list(argv))
    if len(keys) > 1:  # one environment variable holds one key: keep several on the command line
        keys, rest = [], list(argv)
    ns = _parse(rest)
    names = getattr(ns, "served_model_name", None) or []
    return ServeSpec(
        argv=tuple(rest),
        model=getattr(ns, "model_tag", None) or getattr(ns, "model", None),
        host=getattr(ns, "host", None),
        port=int(getattr(ns, "port", None) or 8000),
        served_model_name=names[0] if isinstance(names, list) and names else names or None,
        tensor_parallel_size=int(getattr(ns, "tensor_parallel_size", 1) or 1),
        pipeline_parallel_size=int(getattr(ns, "pipeline_parallel_size", 1) or 1),
        api_key=keys[0] if keys else None,
    )


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]*")
_PATH = re.compile(r"[A-Za-z0-9_./@+-]+")
_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_name(value: str, what: str) -> str:
    if not _NAME.fullmatch(value):
        raise DeployError(f"{what} {value!r} must be letters, digits, '_', '.', '@' or '-'")
    return value


def check_path(value: str, what: str) -> str:
    """Paths go into nginx/systemd/haproxy syntax unquoted: no spaces, quotes or semicolons."""
    if not _PATH.fullmatch(value):
        raise DeployError(f"{what} {value!r} must be a path without spaces, quotes or ';'")
    return value


def check_host_port(value: str, what: str) -> str:
    match = _HOST_PORT.fullmatch(value.strip())
    if not match or not 0 < int(match.group("port")) < 65536:
        raise DeployError(f"{what} {value!r} must be HOST:PORT, e.g. 10.0.0.5:8000")
    return value.strip()


def parse_env(entries: Sequence[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for entry in entries:
        key, sep, value = entry.partition("=")
        if not sep or not _ENV_KEY.fullmatch(key):
            raise DeployError(f"--env {entry!r} must be NAME=VALUE")
        if any(c in value for c in '\n"\\'):
            raise DeployError(f"--env {key}: the value may not contain newlines, quotes or '\\'")
        pairs.append((key, value))
    return tuple(pairs)
