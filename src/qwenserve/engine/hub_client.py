"""HubCoreClient: an API server process's client of the engine core through the launcher's hub
(``--api-server-count N``, ``core_hub.py``). It offers ``AsyncEngine`` what every topology does.

The engine's death reaches it as ``EngineFailed`` from the hub; the hub's (the launcher's) death
ends this process through its stdin pipe (``rank_process.DriverLink``, set up by the worker).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from qwenserve.engine.core_client import EngineStartupError, OutputSink, deliver_to
from qwenserve.engine.core_hub import Attach, Detach, HubAddresses, HubHello
from qwenserve.engine.core_messages import Command, EngineFailed, EngineReady
from qwenserve.engine.request_checks import RequestChecks
from qwenserve.engine.zmq_channel import ZmqChannel

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class HubCoreClient:
    def __init__(self, addresses: HubAddresses, timeout_s: float = 60.0) -> None:
        from qwenserve.models.tokenizer import load_tokenizer

        self._channel = ZmqChannel()
        self._channel.connect(addresses.commands, addresses.outputs)
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
            self._channel.send(Attach())  # again: the first answer may precede our connection
            message = self._channel.recv(200)
            if isinstance(message, HubHello):
                return message
            if isinstance(message, EngineFailed):
                raise EngineStartupError(message.message)
        raise EngineStartupError(f"the launcher's engine hub did not answer within "
                                 f"{timeout_s:.0f} s")

    def start(self, sink: OutputSink) -> None:
        self._channel.start_receiving(deliver_to(sink), "qwenserve-hub-outputs")

    def send(self, command: Command) -> None:
        self._channel.send(command)  # dropped when the hub is gone: this process follows it out

    def shutdown(self) -> None:
        """Detach (the hub aborts what is left of this process's requests); the engine keeps
        serving the other API processes, and the launcher stops it when all have exited."""
        self._channel.send_last(Detach())
        self._channel.close(linger_ms=1000)  # time for the Detach to reach the hub
