"""``qwenserve serve --headless``: this node's data-parallel engines, joined to a head over TCP.

    qwenserve serve MODEL --headless --data-parallel-size N --data-parallel-size-local L
        --data-parallel-start-rank R --data-parallel-address HEAD --data-parallel-rpc-port P

For each rank R..R+L-1 this process says hello to the head (``dp_remote.py``), which answers
with the addresses of that rank's two links, then starts an engine-core process
(``core_proc.py``, ``remote=True``) that connects to them, loads the model and serves the head
until the head says shut down. This process keeps its hello link open with ZeroMQ heartbeats:
when the head is gone (dead, or unreachable) the link drops and the engines are stopped. No API
server runs here. The process exits when its engines have: 0 after the head shut them down, 1
otherwise.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time

import zmq

from qwenserve import envs
from qwenserve.engine.arg_utils import EngineArgs
from qwenserve.engine.core_binding import usable_cores
from qwenserve.engine.dp_client import (
    moe_group_placements,
    replica_bindings,
    replica_device_envs,
)
from qwenserve.engine.dp_config import DataParallelConfig
from qwenserve.engine.dp_remote import DPHello, DPRefused, DPWelcome
from qwenserve.engine.rank_process import send_message
from qwenserve.engine.zmq_channel import disconnected, set_heartbeats
from qwenserve.logger import init_logger

logger = init_logger(__name__)

HEAD_GONE_GRACE_S = 10.0  # a head that shut down told its engines to stop; they need a moment


def run_headless(engine_args: EngineArgs, dp: DataParallelConfig) -> int:
    """Run this node's engines until they exit; the process exit code."""
    from qwenserve.engine.core_proc import CoreProcArguments

    tp = int(getattr(engine_args, "tensor_parallel_size", 1) or 1)
    bindings = replica_bindings(envs.cpu_omp_threads_bind(), usable_cores(), dp.size_local)
    device_envs = replica_device_envs(dp.size_local, tp)
    placements = moe_group_placements(engine_args, dp)  # DP x EP: the head serves the store
    procs: dict[int, subprocess.Popen] = {}
    stop = threading.Event()  # SIGTERM/SIGINT: stop the engines (they follow us out)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ctx = zmq.Context()
    monitors: list[zmq.Socket] = []
    try:
        for k, rank in enumerate(dp.local_ranks):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            set_heartbeats(sock)  # the head's presence: this link drops when the head is gone
            monitors.append(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
            welcome = _join(sock, dp, rank, stop)
            if welcome is None:
                return 1
            env = {**os.environ, **device_envs[k]} if device_envs[k] else None
            procs[rank] = subprocess.Popen([sys.executable, "-m", "qwenserve.engine.core_proc"],
                                           stdin=subprocess.PIPE, env=env)
            send_message(procs[rank], CoreProcArguments(engine_args.for_data_parallel_rank(rank),
                                                        welcome.input_address,
                                                        welcome.output_address, bindings[k],
                                                        placements.get(rank)))
            logger.info("Data-parallel rank %d: engine process %d, serving the head at %s:%d",
                        rank, procs[rank].pid, dp.address, dp.rpc_port)
        return _wait(procs, stop, monitors)
    finally:
        for proc in procs.values():  # their stdin closes: they exit (rank_process.DriverLink)
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        ctx.destroy(linger=0)


def _join(sock: zmq.Socket, dp: DataParallelConfig, rank: int,
          stop: threading.Event) -> DPWelcome | None:
    """Say hello to the head as ``rank`` (it may start later: keep trying until the timeout)."""
    sock.connect(f"tcp://{dp.address}:{dp.rpc_port}")
    sock.send(pickle.dumps(DPHello(rank, dp.size, time.monotonic(), socket.gethostname()),
                           protocol=5))
    deadline = time.monotonic() + envs.engine_ready_timeout_s()
    logger.info("Data-parallel rank %d: joining the head at %s:%d", rank, dp.address,
                dp.rpc_port)
    while time.monotonic() < deadline and not stop.is_set():
        if sock.poll(500):
            reply = pickle.loads(sock.recv())
            if isinstance(reply, DPRefused):
                logger.error("The head refused data-parallel rank %d: %s", rank, reply.message)
                return None
            assert isinstance(reply, DPWelcome)
            return reply
    if not stop.is_set():
        logger.error("No head answered at %s:%d within %.0f s (QWENSERVE_ENGINE_READY_TIMEOUT_S); "
                     "start the head node, or check --data-parallel-address and "
                     "--data-parallel-rpc-port", dp.address, dp.rpc_port,
                     envs.engine_ready_timeout_s())
    return None


def _wait(procs: dict[int, subprocess.Popen], stop: threading.Event,
          monitors: list[zmq.Socket]) -> int:
    """Until every engine has exited (0: all cleanly), a signal, or the head is gone (then the
    engines get a grace period: a head that shut down has told them to stop)."""
    code = 0
    head_gone_at: float | None = None
    while procs and not stop.is_set():
        for rank, proc in list(procs.items()):
            status = proc.poll()
            if status is None:
                continue
            del procs[rank]
            if status != 0:
                logger.error("Data-parallel rank %d: its engine exited with %d", rank, status)
                code = 1
        if head_gone_at is None and any(disconnected(m) for m in monitors):
            head_gone_at = time.monotonic()
        if head_gone_at is not None and time.monotonic() - head_gone_at > HEAD_GONE_GRACE_S:
            logger.error("The head is gone and %d engine(s) still run; stopping them", len(procs))
            return 1
        time.sleep(0.2)
    return code  # a signal stops the engines (finally: their stdin closes): a clean stop
