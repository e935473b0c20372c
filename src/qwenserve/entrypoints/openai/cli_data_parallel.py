"""vLLM's data-parallel flags, checked and resolved into ``DataParallelConfig``
(``engine/dp_config.py`` says what each layout runs).

``--enable-expert-parallel`` with more than one rank makes the replicas one MoE group stepping
together (``engine/dp_lockstep.py``), on one node or several (the group's store on the head at
``--data-parallel-address``, port ``--data-parallel-rpc-port`` + 1), speculative decoding included:
every replica runs the same MoE passes each step (``worker/dp_passes.py``). ``--api-server-count``
above 1 runs that many API processes on the port and the engines (``multi_api_server.py``).
"""

from __future__ import annotations

import argparse

from qwenserve.engine.dp_config import DEFAULT_ADDRESS, DEFAULT_RPC_PORT, DataParallelConfig
from qwenserve.entrypoints.openai.cli_help import AddsArguments
from qwenserve.logger import init_logger

logger = init_logger(__name__)

FLAGS: dict[str, type] = {
    "--data-parallel-size-local": int,
    "--data-parallel-rank": int,
    "--data-parallel-start-rank": int,
    "--data-parallel-address": str,
    "--data-parallel-rpc-port": int,
}
BOOL = argparse.BooleanOptionalAction


def add_data_parallel_flags(group: AddsArguments) -> None:
    group.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                       help="Engine replicas (data-parallel ranks) behind this API server, "
                       "each with --tensor-parallel-size ranks of its own.")
    group.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                       help="Replicas run on this node (default: all of them on the head).")
    group.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=None,
                       help="The first rank this node runs (with --headless).")
    group.add_argument("--data-parallel-rank", "-dpn", type=int, default=None,
                       help="Run only this rank behind this server (vLLM's external load "
                       "balancing: one server per rank).")
    group.add_argument("--data-parallel-address", "-dpa", default=None,
                       help=f"The head node's address (default {DEFAULT_ADDRESS}).")
    group.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None,
                       help=f"The head's port for joining nodes (default {DEFAULT_RPC_PORT}).")
    group.add_argument("--headless", action=BOOL, default=None,
                       help="Run this node's replicas for a head node, without an API server.")
    group.add_argument("--api-server-count", "-asc", type=int, default=None,
                       help="API server processes sharing the port and the engine(s).")


def data_parallel_config(ns: argparse.Namespace) -> DataParallelConfig:
    """The layout the flags describe (call after ``data_parallel_problem`` found none)."""
    size = ns.data_parallel_size or 1
    address = ns.data_parallel_address or DEFAULT_ADDRESS
    port = ns.data_parallel_rpc_port or DEFAULT_RPC_PORT
    if ns.data_parallel_rank is not None and size > 1:
        return DataParallelConfig(size, 1, ns.data_parallel_rank, address, port, external=True)
    start = ns.data_parallel_start_rank or 0
    local = ns.data_parallel_size_local
    if local is None:
        local = size - start
    return DataParallelConfig(size, local, start, address, port, headless=bool(ns.headless))


def data_parallel_problem(ns: argparse.Namespace) -> str | None:
    """The first problem with the data-parallel flags, worded with the fix; None if usable."""
    problem = _api_server_count_problem(ns)
    if problem is not None:
        return problem
    size = ns.data_parallel_size
    if size is not None and size < 1:
        return f"--data-parallel-size {size}: must be >= 1"
    size = size or 1
    rank = ns.data_parallel_rank
    if rank is not None and not 0 <= rank < size:
        return f"--data-parallel-rank {rank}: must be in 0..{size - 1} (--data-parallel-size)"
    if rank is not None and ns.headless:
        return "--data-parallel-rank and --headless: give one (a rank behind its own server, or "\
               "a node of engines for a head)"
    start = ns.data_parallel_start_rank or 0
    local = ns.data_parallel_size_local
    if rank is not None:
        if local not in (None, 1) or start not in (0, rank):
            return (f"--data-parallel-rank {rank} runs that one rank: drop "
                    "--data-parallel-size-local and --data-parallel-start-rank")
        return _log_single(ns, size)
    if not 0 <= start < size:
        return f"--data-parallel-start-rank {start}: must be in 0..{size - 1}"
    local = size - start if local is None else local
    if local < 1 or start + local > size:
        return (f"--data-parallel-size-local {local} from rank {start}: must be 1.."
                f"{size - start} (--data-parallel-size {size})")
    if ns.headless:
        if start == 0:
            return ("--headless runs the ranks after the head's: give "
                    "--data-parallel-start-rank (the head runs rank 0)")
        return None
    if start != 0:
        return (f"--data-parallel-start-rank {start} without --headless: the head node runs "
                "rank 0 onwards; start the other nodes with --headless")
    return _log_single(ns, size)


def _api_server_count_problem(ns: argparse.Namespace) -> str | None:
    """N > 1 API processes share the port and one engine hub (``multi_api_server.py``)."""
    count = getattr(ns, "api_server_count", None)
    if count is None or count == 1:
        return None
    if count < 1:
        return f"--api-server-count {count}: must be >= 1"
    if ns.headless:
        return f"--api-server-count {count} with --headless: a headless node runs no API server"
    if getattr(ns, "kv_transfer_config", None):
        return (f"--api-server-count {count} with --kv-transfer-config: prefill/decode "
                "disaggregation runs one API process per server; drop --api-server-count")
    return None


def _log_single(ns: argparse.Namespace, size: int) -> None:
    if size == 1:
        given = [f"{flag} {value}" for flag in FLAGS
                 if (value := getattr(ns, flag[2:].replace("-", "_"), None)) is not None]
        if given:
            logger.info("%s: no effect with one data-parallel replica", ", ".join(given))
    return None
