"""Several API server processes on one engine core (``--api-server-count N``).

    API process i (HubCoreClient)              hub (the launcher process)       engine core(s)
    PUSH ipc://.../in-i   --- Command --->     PULL in-i  -> rename the ids ->  CoreClient.send
    PULL ipc://.../out-i  <-- StepOutputs --   PUSH out-i <- route by id    <-  sink.on_step

The hub holds the one ``CoreClient`` of whatever topology the flags ask for (one engine process,
or data-parallel replicas), so the engines keep a single client. It renames each request id to
``"<i>|<id>"`` (two API processes may see the same ``X-Request-Id``) and utility-call ids to its
own counter, and sends every output, refusal or result back to the process that asked, with its
own id. Each step's statistics go to API process 0 only: its Prometheus logger counts them once,
and ``/metrics`` of every process shows them (``prometheus_client``'s multiprocess mode).
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import shutil
import tempfile
import threading
from dataclasses import dataclass

import zmq

from qwenserve.engine.core_client import CoreClient
from qwenserve.engine.core_messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityResult,
)
from qwenserve.logger import init_logger

logger = init_logger(__name__)

_SEP = "|"


@dataclass
class Attach:
    """An API process's first message, repeated until the hub's ``HubHello`` arrives."""


@dataclass
class Detach:
    """An API process is done (it drained, or it is exiting): its requests are aborted."""


@dataclass
class HubHello:
    ready: EngineReady
    engine_indexes: tuple[int, ...]


@dataclass(frozen=True)
class HubAddresses:
    commands: str  # the API process's PUSH connects here
    outputs: str  # its PULL connects here


class CoreHub:
    """Relay between N API processes and one ``CoreClient``; see the module docstring."""

    def __init__(self, core: CoreClient, num_clients: int) -> None:
        self.core = core
        self._dir = tempfile.mkdtemp(prefix="qwenserve-hub-")
        self._ctx = zmq.Context()
        self.addresses = [HubAddresses(f"ipc://{self._dir}/in-{i}", f"ipc://{self._dir}/out-{i}")
                          for i in range(num_clients)]
        self._inputs, self._outputs = [], []
        for address in self.addresses:
            pull, push = self._ctx.socket(zmq.PULL), self._ctx.socket(zmq.PUSH)
            pull.setsockopt(zmq.RCVHWM, 0)
            push.setsockopt(zmq.SNDHWM, 0)
            pull.bind(address.commands)
            push.bind(address.outputs)
            self._inputs.append(pull)
            self._outputs.append(push)
        self._out_lock = threading.Lock()  # the push sockets: the sink's threads and the relay's
        self._route_lock = threading.Lock()
        self._owners: dict[str, int] = {}  # engine request id -> API process
        self._calls: dict[int, tuple[int, int]] = {}  # hub call id -> (API process, its id)
        self._call_ids = itertools.count()
        self._closing = False
        # until an API process attaches, what is meant for it waits here (the engine's first
        # statistics come while the API processes still start)
        self._backlog: dict[int, list[bytes]] = {i: [] for i in range(num_clients)}
        self._attached: set[int] = set()
        self._thread = threading.Thread(target=self._relay, name="qwenserve-hub", daemon=True)

    def start(self) -> None:
        self.core.start(self)
        self._thread.start()

    # ---- API processes -> engine --------------------------------------------------------------
    def _relay(self) -> None:
        poller = zmq.Poller()
        for sock in self._inputs:
            poller.register(sock, zmq.POLLIN)
        while not self._closing:
            try:
                ready = dict(poller.poll(500))
                for client, sock in enumerate(self._inputs):
                    if sock in ready:
                        self._command(client, pickle.loads(sock.recv()))
            except zmq.ZMQError:  # closed under us: shutting down
                return

    def _command(self, client: int, message: object) -> None:
        if isinstance(message, Attach):
            hello = HubHello(self.core.ready, tuple(self.core.engine_indexes))
            with self._out_lock:
                # The push fails while the process's output connection is still being made:
                # it asks again until an answer gets through.
                if client in self._attached or not self._push(client, pickle.dumps(hello, 5)):
                    return
                self._attached.add(client)
                for payload in self._backlog.pop(client, []):
                    self._push(client, payload)
        elif isinstance(message, Detach):
            self.abort_client(client)
        elif isinstance(message, AddRequest):
            engine_id = f"{client}{_SEP}{message.request_id}"
            with self._route_lock:
                self._owners[engine_id] = client
            self.core.send(dataclasses.replace(message, request_id=engine_id))
        elif isinstance(message, AbortRequests):
            ids = [f"{client}{_SEP}{r}" for r in message.request_ids]
            with self._route_lock:
                for engine_id in ids:
                    self._owners.pop(engine_id, None)
            self.core.send(AbortRequests(ids))
        elif isinstance(message, UtilityCall):
            call_id = next(self._call_ids)
            with self._route_lock:
                self._calls[call_id] = (client, message.call_id)
            self.core.send(dataclasses.replace(message, call_id=call_id))
        elif not isinstance(message, Shutdown):  # an API process never stops the engine
            logger.warning("The hub ignores %s from API process %d", type(message).__name__,
                           client)

    def abort_client(self, client: int) -> None:
        """Abort what an API process left running (it detached or died)."""
        prefix = f"{client}{_SEP}"
        with self._route_lock:
            ids = [r for r in self._owners if r.startswith(prefix)]
            for r in ids:
                del self._owners[r]
        if ids:
            self.core.send(AbortRequests(ids))

    # ---- engine -> API processes (OutputSink) -------------------------------------------------
    def on_step(self, step: StepOutputs) -> None:
        per_client: dict[int, StepOutputs] = {}

        def part(client: int) -> StepOutputs:
            return per_client.setdefault(client, StepOutputs())

        with self._route_lock:
            for out in step.outputs:
                client = self._owner(out.request_id, out.finished)
                if client is not None:
                    out.request_id = _own_id(out.request_id)
                    part(client).outputs.append(out)
            for kind in ("errors", "failures"):
                for request_id, why in getattr(step, kind):
                    client = self._owner(request_id, True)
                    if client is not None:
                        getattr(part(client), kind).append((_own_id(request_id), why))
            for result in step.results:
                client_call = self._calls.pop(result.call_id, None)
                if client_call is not None:
                    client, call_id = client_call
                    part(client).results.append(UtilityResult(call_id, result.ok,
                                                              result.value))
        if step.stats:
            part(0).stats.extend(step.stats)
        for client, message in per_client.items():
            self._send(client, message)

    def on_dead(self, message: str) -> None:
        for client in range(len(self._outputs)):
            self._send(client, EngineFailed(message))

    def _owner(self, engine_id: str, finished: bool) -> int | None:
        return self._owners.pop(engine_id, None) if finished else self._owners.get(engine_id)

    def _send(self, client: int, message: object) -> None:
        payload = pickle.dumps(message, protocol=5)
        with self._out_lock:
            if self._closing:
                return
            if client not in self._attached:
                self._backlog.setdefault(client, []).append(payload)
                return
            self._push(client, payload)

    def _push(self, client: int, payload: bytes) -> bool:
        try:
            self._outputs[client].send(payload, zmq.NOBLOCK)
            return True
        except zmq.Again:  # not connected yet, or gone (the launcher reports that)
            return False

    def shutdown(self) -> None:
        """Stop relaying and shut the engine(s) down (every API process has exited)."""
        with self._out_lock:
            self._closing = True
        self._thread.join(timeout=5)
        self.core.shutdown()
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


def _own_id(engine_id: str) -> str:
    return engine_id.split(_SEP, 1)[1]
