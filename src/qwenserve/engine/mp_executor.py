"""MultiprocExecutor: tensor parallelism over torch.distributed, one process per rank.

    driver (rank 0, in the engine process)       workers (ranks 1..N-1, spawned)
    schedule() -> broadcast SchedulerOutput  -->  receive -> Worker.execute (forward only)
    Worker.execute (forward + sampling)            collectives inside the layers
    <- ModelOutput (rank 0 only)

The SchedulerOutput is plain data (token ids, block ids), a few KB per step, broadcast once over
the gloo group; tensors never travel between processes except through the collectives.

Each side watches the other. A watchdog thread ends the driver, with the rank's name, as soon as
a worker dies: a dead peer would otherwise leave the survivors blocked in a collective. A worker
exits within a second of its driver's death, however the driver died (SIGKILL included): the
driver holds the only write end of the worker's stdin (``rank_process.py``).

The processes and the process group belong to a ``_Ranks`` object that the executor's finalizer
closes, so ``del llm; gc.collect()`` frees them and a next tensor-parallel ``LLM`` can start in
the same process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from qwenserve.config import EngineConfig
from qwenserve.core.cache.plan import CachePlan
from qwenserve.core.sched_output import ModelOutput, SchedulerOutput
from qwenserve.distributed.init import (
    Rendezvous,
    init_parallel_group,
    join_data_parallel_groups,
    leave_parallel_group,
    rendezvous,
)
from qwenserve.distributed.parallel_group import ParallelGroup
from qwenserve.engine.rank_process import (
    SHUTDOWN,
    RankArguments,
    agree_on_plan,
    send_arguments,
)
from qwenserve.logger import init_logger
from qwenserve.worker.worker import Worker

if TYPE_CHECKING:
    from qwenserve.platforms.base import Platform

logger = init_logger(__name__)

T = TypeVar("T")


class WorkerDiedError(RuntimeError):
    ADVICE = ("Check that rank's log above, and memory (exit code -9 usually means the OS killed "
              "it for lack of memory)")

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}. {self.ADVICE}")


def check_tp_divides(config: EngineConfig) -> None:
    """Fail before spawning anything when the heads cannot be split."""
    tp = config.parallel.tensor_parallel_size
    cfg = config.model.hf_config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0 and d <= 16]
        raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's "
                         f"{heads} attention heads; use one of {divisors}")
    if kv % tp and tp % kv:
        raise ValueError(f"--tensor-parallel-size {tp} and the model's {kv} KV heads: one must "
                         "divide the other (KV heads are split, or replicated when fewer)")


def check_no_process_group() -> None:
    """One tensor-parallel engine per process at a time: it owns torch.distributed's default
    process group (the collectives inside the layers use it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "torch.distributed's default process group is already initialized in this process: "
            "another LLM with tensor_parallel_size > 1 is still alive (or the program set one "
            "up itself). Shut it down first: llm.llm_engine.shutdown(), or del llm; "
            "gc.collect()")


class _Ranks:
    """This node's worker processes and this process's place in the group: everything a
    tensor-parallel engine must release. Kept apart from the executor so that the finalizer and
    the watchdog thread, which hold it, never keep the executor alive."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        self.tp: ParallelGroup | None = None  # set once this process joined the group
        self.serving = False  # every rank is in its step loop (shutdown goes through it)
        self.closed = False

    def spawn(self, config: EngineConfig, rdzv: Rendezvous) -> None:
        """A fresh interpreter per local rank (multiprocessing's spawn would re-import the
        user's __main__, which breaks scripts without a main guard). All start before any is
        sent its arguments, so their imports overlap."""
        for rank in rdzv.local_ranks:
            if rank != 0:
                self.procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "qwenserve.engine.rank_process"],
                    stdin=subprocess.PIPE)
        for local_rank, rank in enumerate(rdzv.local_ranks):
            if rank != 0:
                send_arguments(self.procs[rank], RankArguments(config, rank, local_rank, rdzv))

    def first_death(self, wait_s: float = 0.0) -> str | None:
        """The first worker found dead within ``wait_s``, described for an error message."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in self.procs.items():
                if proc.poll() is not None:
                    return (f"Tensor-parallel worker rank {rank} (pid {proc.pid}) died with exit "
                            f"code {proc.returncode}")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def raise_if_dead(self) -> None:
        dead = self.first_death()
        if dead is not None:
            raise WorkerDiedError(dead)

    def watch(self) -> None:
        """Watchdog thread: end this process when a worker dies and nothing reports it."""
        while not self.closed:
            dead = self.first_death()
            if dead is not None:
                # Give a failing collective in the engine thread a moment to report it first.
                time.sleep(3.0)
                if self.closed:
                    return
                logger.error("%s; stopping qwenserve. %s", dead, WorkerDiedError.ADVICE)
                self._kill()
                os._exit(1)
            time.sleep(0.2)

    def close(self) -> None:
        """Stop the workers and leave the group; safe at any point of a failed start."""
        if self.closed:
            return
        self.closed = True
        alive = self.first_death() is None
        if self.tp is not None and self.tp.is_driver and self.serving and alive:
            try:  # every worker waits for the next step: tell it to stop
                self.tp.broadcast_object(SHUTDOWN)
            except Exception:  # a worker went meanwhile
                alive = False
        else:  # mid-start, or a rank is gone: nobody waits for a message
            self._kill()
        if self.tp is not None:
            leave_parallel_group(self.tp, meet=self.serving and alive)
            self.tp = None
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()

    def _kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()


class MultiprocExecutor:
    dp_group: ParallelGroup | None = None  # DP x EP: the replicas' drivers (lock-step)

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        check_tp_divides(config)
        check_no_process_group()
        self.config = config
        placement = config.parallel.data_parallel
        if placement is None:
            rdzv, listener = rendezvous(config.parallel.tensor_parallel_size)
        else:  # DP x EP: every replica's ranks meet at the store the API process serves
            rdzv = Rendezvous(placement.host, placement.port, config.parallel.tensor_parallel_size)
            listener = None
        moe: ParallelGroup | None = None
        self.is_driver_node = rdzv.node_rank == 0
        self._ranks = _Ranks()
        # Runs on shutdown(), when the executor is collected, or at exit: whichever comes first.
        self._finalizer = weakref.finalize(self, self._ranks.close)
        try:
            self._ranks.spawn(config, rdzv)
            threading.Thread(target=self._ranks.watch, daemon=True,
                             name="qwenserve-worker-watch").start()
            if not self.is_driver_node:
                self._host_workers(rdzv)
            platform.device(0)
            if placement is None:
                self.tp = init_parallel_group(platform.dist_backend, 0, rdzv, listener,
                                              check_peers=self._ranks.raise_if_dead)
            else:
                groups = join_data_parallel_groups(
                    platform.dist_backend, placement.rank, placement.size, rdzv.world_size, 0,
                    placement.host, placement.port)
                self.tp, moe, self.dp_group = groups.tp, groups.moe, groups.drivers
            self._ranks.tp = self.tp
            self.worker = Worker(config, platform, self.tp, 0, dp_ep=moe)
            self.worker.load_model()
        except BaseException:
            if listener is not None:
                listener.close()  # a no-op once the store took it over
            self.shutdown()
            raise
        self.specs = self.worker.specs
        self.load_s = self.worker.load_s

    @property
    def procs(self) -> dict[int, subprocess.Popen]:
        """This node's worker processes by rank."""
        return self._ranks.procs

    def _host_workers(self, rdzv: Rendezvous) -> None:
        """A node other than 0 only hosts workers (NODE_RANK > 0): serve them until they stop."""
        logger.info("Node %d hosts tensor-parallel ranks %s; waiting for node 0",
                    rdzv.node_rank, list(rdzv.local_ranks))
        codes = [proc.wait() for proc in self.procs.values()]
        self.shutdown()
        sys.exit(max(codes, default=0))

    def plan_cache(self) -> CachePlan:
        return self._starting(lambda: agree_on_plan(self.worker, self.tp))

    def init_cache(self, plan: CachePlan) -> None:
        def init() -> None:
            self.worker.init_cache(plan)
            self.worker.warm_up()

        self._starting(init)
        self._ranks.serving = True

    def _starting(self, step: Callable[[], T]) -> T:
        """A start-up step that fails ends the executor: the engine is never built, and
        nothing else would stop the workers before exit."""
        try:
            return step()
        except BaseException:
            self.shutdown()
            raise

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        try:
            self.tp.broadcast_object(sched)
            return self.worker.execute(sched)
        except RuntimeError as e:  # a collective failed: name the rank that died, if one did
            dead = self._ranks.first_death(wait_s=2.0)
            if dead is None:
                raise
            raise WorkerDiedError(dead) from e

    def weight_bytes(self) -> int:
        return self.worker.weight_bytes()

    def describe_device(self) -> str:
        desc = self.worker.platform.describe(self.worker.device)
        return f"{desc} x {self.config.parallel.tensor_parallel_size} ranks"

    def shutdown(self) -> None:
        worker = getattr(self, "worker", None)  # absent when start-up failed before it
        if worker is not None:
            worker.close()  # the driver's KV-transfer threads (--kv-transfer-config)
        self._finalizer()
