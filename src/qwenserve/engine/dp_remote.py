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
from qwenserve.engine.core_client import EngineStartupError, OutputSink, deliver_to
from qwenserve.engine.core_messages import AddRequest, Command, EngineFailed, EngineReady, Shutdown
from qwenserve.engine.dp_config import DataParallelConfig
from qwenserve.engine.zmq_channel import ZmqChannel
from qwenserve.logger import init_logger

logger = init_logger(__name__)


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


class RemoteCoreLink:
    """One remote engine, seen from the head: the same face as ``ProcCoreClient``."""

    def __init__(self, ctx: zmq.Context, address: str, rank: int) -> None:
        self.rank = rank
        self._channel = ZmqChannel(ctx, watch_peer=True)
        self.input_address, self.output_address = self._channel.bind_to_random_ports(
            f"tcp://{address}")
        self.joined = threading.Event()
        self.peer = "?"
        self.clock_offset_s = 0.0  # head's monotonic clock minus the node's
        self.ready: EngineReady

    def wait_ready(self, deadline: float) -> RemoteCoreLink:
        while not self.joined.wait(0.2):
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"no --headless node joined as data-parallel rank {self.rank} within "
                    f"{envs.engine_ready_timeout_s():.0f} s (QWENSERVE_ENGINE_READY_TIMEOUT_S)")
        while time.monotonic() < deadline:
            if self._channel.peer_disconnected():
                raise EngineStartupError(f"the engine on {self.peer} exited while loading the "
                                         "model; see that node's log")
            message = self._channel.recv(200)
            if isinstance(message, EngineReady):
                self.ready = message
                return self
            if isinstance(message, EngineFailed):
                raise EngineStartupError(f"on {self.peer}: {message.message}")
        raise EngineStartupError(f"the engine on {self.peer} did not load the model in time "
                                 "(QWENSERVE_ENGINE_READY_TIMEOUT_S)")

    def start(self, sink: OutputSink) -> None:
        def dropped() -> None:
            if not self._channel.closing:
                sink.on_dead(f"the connection to its node {self.peer} dropped")

        self._channel.start_receiving(deliver_to(sink), f"qwenserve-dp{self.rank}-outputs",
                                      on_end=dropped)

    def send(self, command: Command) -> None:
        if isinstance(command, AddRequest):  # the node's clock
            command = dataclasses.replace(command,
                                          arrival_time=command.arrival_time
                                          - self.clock_offset_s)
        self._channel.send(command)  # dropped when the node is gone: its disconnect reports it

    def shutdown(self) -> None:
        self._channel.send_last(Shutdown())
        self._channel.wait_receiving(30)  # the node's engine exits, and its connection drops
        self._channel.close()


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

