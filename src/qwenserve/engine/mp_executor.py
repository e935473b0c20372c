"""MultiprocExecutor: tensor parallelism over torch.distributed, one process per rank.

    driver (rank 0, in the engine process)       workers (ranks 1..N-1, spawned)
    schedule() -> broadcast SchedulerOutput  -->  receive -> Worker.execute (forward only)
    Worker.execute (forward + sampling)            collectives inside the layers
    <- ModelOutput (rank 0 only)

The SchedulerOutput is plain data (token ids, block ids), a few KB per step, broadcast once over
the gloo group; tensors never travel between processes except through the collectives. A
watchdog thread ends the driver, with the rank's name, as soon as a worker dies: a dead peer would
otherwise leave the survivors blocked in a collective.
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading
import time
from typing import Any

from qwenserve.config import EngineConfig
from qwenserve.core.cache.plan import CachePlan
from qwenserve.core.sched_output import ModelOutput, SchedulerOutput
from qwenserve.distributed.init import Rendezvous, init_parallel_group, rendezvous
from qwenserve.logger import init_logger
from qwenserve.platforms import resolve_platform
from qwenserve.worker.worker import Worker

logger = init_logger(__name__)

_SHUTDOWN = "shutdown"


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


def _worker_main(config: EngineConfig, rank: int, local_rank: int, rdzv: Rendezvous) -> None:
    """Entry point of ranks 1..N-1: set up, then execute broadcast steps until told to stop."""
    platform = resolve_platform(config.platform_name)
    platform.device(local_rank)
    tp = init_parallel_group(platform.dist_backend, rank, rdzv)
    _watch_parent()
    worker = Worker(config, tp, local_rank)
    worker.load_model()
    plan = _agree_on_plan(worker, tp)
    worker.init_cache(plan)
    worker.warm_up()
    while True:
        sched = tp.broadcast_object(None)
        if sched == _SHUTDOWN:
            break
        worker.execute(sched)
    _leave_group(tp)


def _leave_group(tp: Any, meet: bool = True) -> None:
    """Every rank meets once more, then destroys its process group: a rank that tears down
    gloo while a peer is still using the connection can abort at exit ("terminate called
    without an active exception"). A peer that is gone makes the barrier time out, not hang."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if meet:
        try:
            dist.monitored_barrier(group=tp.cpu_group, timeout=datetime.timedelta(seconds=10))
        except Exception:  # a peer died or already left
            pass
    dist.destroy_process_group()


def _agree_on_plan(worker: Worker, tp: Any) -> CachePlan:
    """Every rank sizes its cache; all use the smallest (rank 0's plan with the min blocks)."""
    import dataclasses

    import torch
    import torch.distributed as dist

    plan = worker.plan_cache()
    blocks = torch.tensor([plan.num_blocks], dtype=torch.long)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return dataclasses.replace(plan, num_blocks=int(blocks.item()))


def _watch_parent() -> None:
    """Workers exit when the driver process is gone (its death cannot be signalled to them)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="qwenserve-parent-watch").start()


def _spawn_worker(config: EngineConfig, rank: int, local_rank: int,
                  rdzv: Rendezvous) -> subprocess.Popen:
    """A fresh interpreter running this module, arguments pickled on stdin. (multiprocessing's
    spawn would re-import the user's __main__, which breaks scripts without a main guard.)"""
    proc = subprocess.Popen([sys.executable, "-m", "qwenserve.engine.mp_executor"],
                            stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps((config, rank, local_rank, rdzv)))
    proc.stdin.close()
    return proc


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        check_tp_divides(config)
        self.config = config
        world = config.parallel.tensor_parallel_size
        rdzv = rendezvous(world)
        self.is_driver_node = rdzv.node_rank == 0
        self.procs: dict[int, subprocess.Popen] = {}
        for local_rank, rank in enumerate(rdzv.local_ranks):
            if rank != 0:
                self.procs[rank] = _spawn_worker(config, rank, local_rank, rdzv)
        self._closing = False
        atexit.register(self.shutdown)  # runs before multiprocessing reaps the daemon workers
        threading.Thread(target=self._watch_workers, daemon=True,
                         name="qwenserve-worker-watch").start()
        if not self.is_driver_node:
            # This node only hosts workers (NODE_RANK > 0): serve them until they stop.
            logger.info("Node %d hosts tensor-parallel ranks %s; waiting for node 0",
                        rdzv.node_rank, list(rdzv.local_ranks))
            codes = [proc.wait() for proc in self.procs.values()]
            self._closing = True
            sys.exit(max(codes, default=0))
        platform = resolve_platform(config.platform_name)
        platform.device(0)
        self.tp = init_parallel_group(platform.dist_backend, 0, rdzv)
        self.worker = Worker(config, self.tp, 0)
        self.worker.load_model()
        self.specs = self.worker.specs
        self.load_s = self.worker.load_s

    def _watch_workers(self) -> None:
        while not self._closing:
            dead = self._dead_worker(wait_s=0.0)
            if dead is not None and not self._closing:
                # Give a failing collective in the engine thread a moment to report it first.
                time.sleep(3.0)
                if self._closing:
                    return
                logger.error("%s; stopping qwenserve. %s", dead, WorkerDiedError.ADVICE)
                for other in self.procs.values():
                    if other.poll() is None:
                        other.kill()
                os._exit(1)
            time.sleep(0.2)

    def plan_cache(self) -> CachePlan:
        return _agree_on_plan(self.worker, self.tp)

    def init_cache(self, plan: CachePlan) -> None:
        self.worker.init_cache(plan)
        self.worker.warm_up()

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        try:
            self.tp.broadcast_object(sched)
            return self.worker.execute(sched)
        except RuntimeError as e:  # a collective failed: name the rank that died, if one did
            dead = self._dead_worker(wait_s=2.0)
            if dead is None:
                raise
            raise WorkerDiedError(dead) from e

    def _dead_worker(self, wait_s: float) -> str | None:
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in self.procs.items():
                if proc.poll() is not None:
                    return (f"Tensor-parallel worker rank {rank} (pid {proc.pid}) died with exit "
                            f"code {proc.returncode}")
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def weight_bytes(self) -> int:
        return self.worker.weight_bytes()

    def describe_device(self) -> str:
        desc = self.worker.platform.describe(self.worker.device)
        return f"{desc} x {self.config.parallel.tensor_parallel_size} ranks"

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self.is_driver_node:
            try:
                self.tp.broadcast_object(_SHUTDOWN)
                peers_alive = True
            except Exception:  # workers already gone
                peers_alive = False
            _leave_group(self.tp, meet=peers_alive)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    _worker_main(*pickle.loads(sys.stdin.buffer.read()))
