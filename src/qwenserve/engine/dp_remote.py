"""Data-parallel engines on other nodes: the head's side of the TCP link, and the handshake.

    headless node (dp_headless.py)                 head (this module)
    DEALER --- DPHello(rank, size, clock) ---->    ROUTER tcp://ADDRESS:RPC_PORT
           <-- DPWelcome(input, output) -------    (or DPRefused(why): wrong size, rank taken)
    engine-core process (core_proc, remote=True)
    PULL connects to input   <--- Command -----    PUSH bound on tcp://ADDRESS:<free port>
    PUSH connects to output  ---- StepOutputs ->   PULL bound on tcp://ADDRESS:<free port>

ZeroMQ heartbeats run on both links, so a dead or unreachable peer is a dropped connection within
seconds: on the head that is the engine dying (``on_dead``), on the node the engine exits. The
messages are pickles, as between local processes: the RPC port must only be reachable from the
deployment's own nodes (vLLM has the same rule).
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time
from dataclasses import dataclass

import zmq

from qwenserve import envs
from qwenserve.engine.core_client import EngineStartupError, OutputSink
from qwenserve.engine.core_messages import (
    AddRequest,
    Command,
    EngineFailed,
    EngineReady,
    Shutdown,
    StepOutputs,
)
from qwenserve.engine.dp_config import DataParallelConfig
from qwenserve.logger import init_logger

logger = init_logger(__name__)

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


@dataclass(frozen=True)
class DPHello:
    rank: int
    size: int
    monotonic_s: float  # the node's time.monotonic() (arrival times are rebased to its clock)
    host: str


@dataclass(frozen=True)
class DPWelcome:
    input_address: str
    output_address: str


@dataclass(frozen=True)
class DPRefused:
    message: str


def set_heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


class RemoteCoreLink:
    """One remote engine, seen from the head: the same face as ``ProcCoreClient``."""

    def __init__(self, ctx: zmq.Context, address: str, rank: int) -> None:
        self.rank = rank
        self._input = ctx.socket(zmq.PUSH)
        self._output = ctx.socket(zmq.PULL)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._output.setsockopt(zmq.RCVHWM, 0)
        for sock in (self._input, self._output):
            sock.setsockopt(zmq.LINGER, 0)
            set_heartbeats(sock)
        host = f"tcp://{address}"
        self.input_address = f"{host}:{self._input.bind_to_random_port(host)}"
        self.output_address = f"{host}:{self._output.bind_to_random_port(host)}"
        self._monitor = self._output.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.joined = threading.Event()
        self.peer = "?"
        self.clock_offset_s = 0.0  # head's monotonic clock minus the node's
        self._send_lock = threading.Lock()
        self._closing = False
        self._gone = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready: EngineReady

    def wait_ready(self, deadline: float) -> RemoteCoreLink:
        while not self.joined.wait(0.2):
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"no --headless node joined as data-parallel rank {self.rank} within "
                    f"{envs.engine_ready_timeout_s():.0f} s (QWENSERVE_ENGINE_READY_TIMEOUT_S)")
        while time.monotonic() < deadline:
            if self._monitor.poll(0) and disconnected(self._monitor):
                raise EngineStartupError(f"the engine on {self.peer} exited while loading the "
                                         "model; see that node's log")
            if self._output.poll(200):
                message = pickle.loads(self._output.recv())
                if isinstance(message, EngineReady):
                    self.ready = message
                    return self
                if isinstance(message, EngineFailed):
                    raise EngineStartupError(f"on {self.peer}: {message.message}")
        raise EngineStartupError(f"the engine on {self.peer} did not load the model in time "
                                 "(QWENSERVE_ENGINE_READY_TIMEOUT_S)")

    def start(self, sink: OutputSink) -> None:
        self._thread = threading.Thread(target=self._receive, args=(sink,), daemon=True,
                                        name=f"qwenserve-dp{self.rank}-outputs")
        self._thread.start()

    def send(self, command: Command) -> None:
        if isinstance(command, AddRequest):  # the node's clock
            command = dataclasses.replace(command,
                                          arrival_time=command.arrival_time
                                          - self.clock_offset_s)
        payload = pickle.dumps(command, protocol=5)
        with self._send_lock:
            if self._closing:
                return
            try:
                self._input.send(payload, zmq.NOBLOCK)
            except zmq.ZMQError:  # the node is gone; its disconnect reports it
                pass

    def shutdown(self) -> None:
        with self._send_lock:
            if not self._closing:
                self._closing = True
                try:
                    self._input.send(pickle.dumps(Shutdown(), protocol=5), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        if self._thread is not None:
            self._gone.wait(30)  # the node's engine exits, and its connection drops
            self._thread.join(timeout=5)
        self._monitor.close(linger=0)
        self._input.close(linger=0)
        self._output.close(linger=0)

    def _receive(self, sink: OutputSink) -> None:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            try:
                events = dict(poller.poll(500))
                if self._monitor in events and disconnected(self._monitor):
                    break
                if self._output not in events:
                    continue
                message = pickle.loads(self._output.recv())
            except zmq.ZMQError:
                break
            if isinstance(message, StepOutputs):
                sink.on_step(message)
            elif isinstance(message, EngineFailed):
                sink.on_dead(message.message)
        self._gone.set()
        if not self._closing:
            sink.on_dead(f"the connection to its node {self.peer} dropped")


class RemoteReplicas:
    """The head's handshake socket and the links of every remote rank."""

    def __init__(self, dp: DataParallelConfig) -> None:
        self.dp = dp
        self._ctx = zmq.Context()
        self._handshake = self._ctx.socket(zmq.ROUTER)
        self._handshake.setsockopt(zmq.LINGER, 0)
        endpoint = f"tcp://{dp.address}:{dp.rpc_port}"
        try:
            self._handshake.bind(endpoint)
            self.links = {r: RemoteCoreLink(self._ctx, dp.address, r) for r in dp.remote_ranks}
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise EngineStartupError(
                f"cannot listen for data-parallel nodes on {dp.address}:{dp.rpc_port}: {e} "
                "(pick another --data-parallel-rpc-port, or an address of this host for "
                "--data-parallel-address)") from e
        self.deadline = time.monotonic() + envs.engine_ready_timeout_s()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._answer, daemon=True,
                                        name="qwenserve-dp-handshake")
        self._thread.start()

    def wait_ready(self, rank: int) -> RemoteCoreLink:
        return self.links[rank].wait_ready(self.deadline)

    def close_handshake(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._handshake.close(linger=0)

    def _answer(self) -> None:
        while not self._stop.is_set():
            if not self._handshake.poll(200):
                continue
            identity, payload = self._handshake.recv_multipart()
            hello = pickle.loads(payload)
            reply = self._welcome(hello) if isinstance(hello, DPHello) else DPRefused(
                "not a data-parallel hello")
            self._handshake.send_multipart([identity, pickle.dumps(reply, protocol=5)])

    def _welcome(self, hello: DPHello) -> DPWelcome | DPRefused:
        if hello.size != self.dp.size:
            return DPRefused(f"the head runs --data-parallel-size {self.dp.size}, this node "
                             f"{hello.size}; start every node with the same size")
        link = self.links.get(hello.rank)
        if link is None:
            return DPRefused(f"data-parallel rank {hello.rank} is not one the head waits for "
                             f"(it waits for {', '.join(map(str, self.links))}); check "
                             "--data-parallel-start-rank and --data-parallel-size-local")
        if link.joined.is_set():
            return DPRefused(f"data-parallel rank {hello.rank} has already joined from "
                             f"{link.peer}")
        link.peer = hello.host
        link.clock_offset_s = time.monotonic() - hello.monotonic_s
        link.joined.set()
        logger.info("Data-parallel rank %d joined from %s", hello.rank, hello.host)
        return DPWelcome(link.input_address, link.output_address)


def disconnected(monitor: zmq.Socket) -> bool:
    from zmq.utils.monitor import recv_monitor_message

    try:
        event = recv_monitor_message(monitor, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return bool(event["event"] & zmq.EVENT_DISCONNECTED)
