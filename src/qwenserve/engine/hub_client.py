"""HubCoreClient: an API server process's client of the engine core through the launcher's hub
(``--api-server-count N``, ``core_hub.py``). It offers ``AsyncEngine`` what every topology does.

The engine's death reaches it as ``EngineFailed`` from the hub; the hub's (the launcher's) death
ends this process through its stdin pipe (``rank_process.DriverLink``, set up by the worker).
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import TYPE_CHECKING

import zmq

from qwenserve.engine.core_client import EngineStartupError, OutputSink
from qwenserve.engine.core_hub import Attach, Detach, HubAddresses, HubHello
from qwenserve.engine.core_messages import Command, EngineFailed, EngineReady, StepOutputs
from qwenserve.engine.request_checks import RequestChecks

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class HubCoreClient:
    def __init__(self, addresses: HubAddresses, timeout_s: float = 60.0) -> None:
        from qwenserve.models.tokenizer import load_tokenizer

        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._outputs = self._ctx.socket(zmq.PULL)
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._commands.connect(addresses.commands)
        self._outputs.connect(addresses.outputs)
        self._lock = threading.Lock()
        self._closing = False
        self._thread: threading.Thread | None = None
        hello = self._hello(timeout_s)
        self.ready: EngineReady = hello.ready
        self._engine_indexes = hello.engine_indexes
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(self.ready.config.model)
        self.checks = RequestChecks(self.ready.config, self.tokenizer)

    @property
    def engine_indexes(self) -> tuple[int, ...]:
        return self._engine_indexes

    def _hello(self, timeout_s: float) -> HubHello:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._send(Attach())  # again: the first answer may precede our connection
            if self._outputs.poll(200):
                message = pickle.loads(self._outputs.recv())
                if isinstance(message, HubHello):
                    return message
                if isinstance(message, EngineFailed):
                    raise EngineStartupError(message.message)
        raise EngineStartupError(f"the launcher's engine hub did not answer within "
                                 f"{timeout_s:.0f} s")

    def start(self, sink: OutputSink) -> None:
        self._thread = threading.Thread(target=self._receive, args=(sink,),
                                        name="qwenserve-hub-outputs", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        self._send(command)

    def _send(self, message: object) -> None:
        payload = pickle.dumps(message, protocol=5)
        with self._lock:
            if self._closing:
                return
            try:
                self._commands.send(payload, zmq.NOBLOCK)
            except zmq.Again:  # the hub is gone; this process follows it out
                pass

    def shutdown(self) -> None:
        """Detach (the hub aborts what is left of this process's requests); the engine keeps
        serving the other API processes, and the launcher stops it when all have exited."""
        self._send(Detach())
        with self._lock:
            self._closing = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._ctx.destroy(linger=1000)

    def _receive(self, sink: OutputSink) -> None:
        while not self._closing:
            try:
                if not self._outputs.poll(500):
                    continue
                message = pickle.loads(self._outputs.recv())
            except zmq.ZMQError:  # closed under us: shutting down
                return
            if isinstance(message, StepOutputs):
                sink.on_step(message)
            elif isinstance(message, EngineFailed):
                sink.on_dead(message.message)
