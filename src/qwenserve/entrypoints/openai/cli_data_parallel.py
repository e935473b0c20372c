"""vLLM's data-parallel flags. qwenserve runs one engine replica per server, so they are accepted
where they describe exactly that (``--data-parallel-size 1``, as vLLM Ascend's single-node guides
pass them, with the address/port a multi-replica run would use) and refused otherwise, with the
way to get replicas today: one server per replica behind a load balancer."""

from __future__ import annotations

import argparse

from qwenserve.entrypoints.openai.cli_help import AddsArguments
from qwenserve.logger import init_logger

logger = init_logger(__name__)

# flag -> the value that means "this one replica" (None: any value, unused with one replica)
SINGLE_REPLICA = {
    "--data-parallel-size-local": 1,
    "--data-parallel-rank": 0,
    "--data-parallel-start-rank": 0,
    "--data-parallel-address": None,
    "--data-parallel-rpc-port": None,
}
_TYPES = {"--data-parallel-address": str, "--data-parallel-rpc-port": int}
REPLICAS_HINT = ("run one qwenserve server per replica behind a load balancer (`qwenserve "
                 "deploy nginx|haproxy` writes one)")


def add_data_parallel_flags(group: AddsArguments) -> None:
    for flag in SINGLE_REPLICA:
        group.add_argument(flag, type=_TYPES.get(flag, int), default=None,
                           help=argparse.SUPPRESS)


def data_parallel_problem(ns: argparse.Namespace) -> str | None:
    """None when the data-parallel flags describe one replica (then logs that they do nothing)."""
    size = getattr(ns, "data_parallel_size", None)
    if size not in (None, 1):
        return (f"--data-parallel-size {size}: data parallelism is not implemented yet in "
                f"qwenserve; {REPLICAS_HINT}")
    given = []
    for flag, single in SINGLE_REPLICA.items():
        value = getattr(ns, flag[2:].replace("-", "_"), None)
        if value is None:
            continue
        if single is not None and value != single:
            return (f"{flag} {value}: data parallelism is not implemented yet in qwenserve "
                    f"(one replica per server); {REPLICAS_HINT}")
        given.append(f"{flag} {value}")
    if given:
        logger.info("%s: no effect with one data-parallel replica", ", ".join(given))
    return None
