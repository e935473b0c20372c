"""A tensor-parallel worker process (ranks 1..N-1), and what its driver shares with it.

    driver (MultiprocExecutor)                   python -m qwenserve.engine.rank_process
    Popen(stdin=PIPE)
    send_arguments: length + pickle   ------>   read the arguments from stdin
    keeps its end of the pipe open              a thread waits on stdin: EOF = driver gone
    dies, however (SIGKILL too): the  ------>   EOF within a second -> exit at once
    kernel closes its end

Only the driver holds the pipe's write end (it is not inheritable), so the worker learns of its
driver's death at once, also when the driver is itself a child of another process. Without it a
worker would wait out a TCPStore or collective timeout (ten minutes) after its driver died.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
from typing import TYPE_CHECKING

from qwenserve.logger import init_logger

if TYPE_CHECKING:  # imported when needed: the driver watch starts before torch is imported
    from qwenserve.config import EngineConfig
    from qwenserve.core.cache.plan import CachePlan
    from qwenserve.distributed.init import Rendezvous
    from qwenserve.distributed.parallel_group import ParallelGroup
    from qwenserve.worker.worker import Worker

logger = init_logger(__name__)

SHUTDOWN = "shutdown"  # broadcast in place of a SchedulerOutput: leave the step loop
_HEADER = struct.Struct("<Q")  # the pickled arguments' length


@dataclasses.dataclass(frozen=True)
class RankArguments:
    config: EngineConfig
    rank: int
    local_rank: int
    rdzv: Rendezvous


def send_arguments(proc: subprocess.Popen, args: RankArguments) -> None:
    """Write the arguments to the worker's stdin, and keep the pipe open: it is the worker's
    lifeline."""
    send_message(proc, args)


def send_message(proc: subprocess.Popen, message: object) -> None:
    """Write one length-prefixed pickle to a child's stdin (also the engine core process's
    start-up arguments); the pipe stays open as the child's lifeline."""
    assert proc.stdin is not None
    payload = pickle.dumps(message)
    proc.stdin.write(_HEADER.pack(len(payload)) + payload)
    proc.stdin.flush()


def agree_on_plan(worker: Worker, tp: ParallelGroup) -> CachePlan:
    """Every rank sizes its cache; all use the smallest (rank 0's plan with the min blocks)."""
    import torch
    import torch.distributed as dist

    plan = worker.plan_cache()
    blocks = torch.tensor([plan.num_blocks], dtype=torch.long)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return dataclasses.replace(plan, num_blocks=int(blocks.item()))


def run_rank(args: RankArguments) -> None:
    """Set up, then execute broadcast steps until told to stop."""
    from qwenserve.distributed.init import (
        init_parallel_group,
        join_data_parallel_groups,
        leave_parallel_group,
    )
    from qwenserve.platforms import resolve_platform
    from qwenserve.worker.worker import Worker

    platform = resolve_platform(args.config.platform_name)
    platform.device(args.local_rank)
    placement, moe = args.config.parallel.data_parallel, None
    if placement is None:
        tp = init_parallel_group(platform.dist_backend, args.rank, args.rdzv)
    else:  # DP x EP: the MoE group spans every replica's ranks
        groups = join_data_parallel_groups(platform.dist_backend, placement.rank,
                                           placement.size, args.rdzv.world_size, args.rank,
                                           placement.host, placement.port)
        tp, moe = groups.tp, groups.moe
    worker = Worker(args.config, platform, tp, args.local_rank, dp_ep=moe)
    worker.load_model()
    worker.init_cache(agree_on_plan(worker, tp))
    worker.warm_up()
    while (sched := tp.broadcast_object(None)) != SHUTDOWN:
        worker.execute(sched)
    leave_parallel_group(tp)


@dataclasses.dataclass(frozen=True)
class DriverLink:
    """How a worker knows its driver is alive: the pipe ``fd`` is open, and the parent is
    still ``parent`` (should a process the driver forked still hold the pipe)."""

    fd: int
    parent: int
    role: str = "Tensor-parallel worker"

    def gone(self, wait_s: float = 0.0) -> bool:
        readable, _, _ = select.select([self.fd], [], [], wait_s)
        if readable and not os.read(self.fd, 4096):  # EOF
            return True
        return os.getppid() != self.parent

    def exit(self) -> None:
        logger.error("%s %d: its driver process (pid %d) is gone; exiting", self.role,
                     os.getpid(), self.parent)
        sys.stderr.flush()
        os._exit(1)

    def watch(self) -> None:
        """Exit this process as soon as the driver is gone, from a background thread."""

        def watch() -> None:
            while not self.gone(wait_s=1.0):
                pass
            self.exit()

        threading.Thread(target=watch, daemon=True, name="qwenserve-driver-watch").start()


def read_message(fd: int) -> bytes | None:
    """The driver's pickled arguments, or None when the pipe closed first (driver gone)."""
    header = _read_exactly(fd, _HEADER.size)
    return None if header is None else _read_exactly(fd, _HEADER.unpack(header)[0])


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks: list[bytes] = []
    while size:
        chunk = os.read(fd, size)
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def main() -> None:
    stdin = 0
    payload = read_message(stdin)  # at once: the driver writes it right after spawning
    if payload is None:
        raise SystemExit(1)
    driver = DriverLink(stdin, os.getppid())
    driver.watch()  # before unpickling, which imports transformers and torch
    try:
        run_rank(pickle.loads(payload))
    except Exception:
        if driver.gone(wait_s=1.0):  # a collective failed because the driver died: say so
            driver.exit()
        raise
    # Nothing is left to save, and tearing down the interpreter's modules (torch,
    # transformers) takes seconds that the driver's shutdown would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
