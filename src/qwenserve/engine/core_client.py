"""The API process's side of the engine core: what every topology offers ``AsyncEngine``, and
``ProcCoreClient``, which runs the core in its own process (``core_proc.py``) over ZeroMQ.

    start(sink): outputs arrive on a receiving thread as sink.on_step(StepOutputs), once per step
    send(command): add / abort / utility call, never blocks
    the engine process dies, however (kill -9 too) -> sink.on_dead(message) within a second

The engine process is the API process's child and holds the read end of a pipe to it, so it
exits as soon as the API process dies (``rank_process.DriverLink``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from qwenserve import envs
from qwenserve.config import DataParallelRank
from qwenserve.engine.arg_utils import EngineArgs
from qwenserve.engine.core_messages import (
    Command,
    EngineFailed,
    EngineReady,
    Shutdown,
    StepOutputs,
)
from qwenserve.engine.rank_process import send_message
from qwenserve.engine.request_checks import RequestChecks
from qwenserve.engine.zmq_channel import ZmqChannel
from qwenserve.logger import init_logger

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine died; the server reports unhealthy and exits (or, kept alive, answers 503)."""


class EngineStartupError(RuntimeError):
    """The engine process could not load the model; the message says why."""


class OutputSink(Protocol):
    def on_step(self, step: StepOutputs) -> None: ...

    def on_dead(self, message: str) -> None: ...


def deliver_to(sink: OutputSink) -> Callable[[object], None]:
    """What a client's receiving thread does with each message from its engine (or hub)."""

    def deliver(message: object) -> None:
        if isinstance(message, StepOutputs):
            sink.on_step(message)
        elif isinstance(message, EngineFailed):
            sink.on_dead(message.message)

    return deliver


class CoreClient(Protocol):
    ready: EngineReady
    checks: RequestChecks
    tokenizer: PreTrainedTokenizerBase

    @property
    def engine_indexes(self) -> tuple[int, ...]: ...  # the engines' data-parallel ranks

    def start(self, sink: OutputSink) -> None: ...

    def send(self, command: Command) -> None: ...

    def shutdown(self) -> None: ...


class ProcCoreClient:
    """Start the engine process, wait until it has loaded the model, then relay."""

    engine_indexes: tuple[int, ...] = (0,)

    def __init__(self, engine_args: EngineArgs, omp_threads_bind: str | None = None,
                 env: dict[str, str] | None = None,
                 data_parallel: DataParallelRank | None = None) -> None:
        """``omp_threads_bind`` and ``env`` (added to the engine process's environment) give a
        data-parallel replica its own cores and devices, ``data_parallel`` its rank in the MoE
        group over the replicas (``dp_client.py``)."""
        from qwenserve.engine.core_proc import CoreProcArguments
        from qwenserve.models.tokenizer import load_tokenizer

        self._dir = tempfile.mkdtemp(prefix="qwenserve-engine-")
        self._channel = ZmqChannel()
        input_address = f"ipc://{self._dir}/input"
        output_address = f"ipc://{self._dir}/output"
        self._channel.bind(input_address, output_address)
        self._watch_thread: threading.Thread | None = None
        self._proc = subprocess.Popen([sys.executable, "-m", "qwenserve.engine.core_proc"],
                                      stdin=subprocess.PIPE,
                                      env={**os.environ, **env} if env else None)
        # The tokenizer's imports (transformers) load here while the engine loads the model.
        threading.Thread(target=_import_tokenizer_modules, daemon=True).start()
        try:
            send_message(self._proc, CoreProcArguments(engine_args, input_address,
                                                       output_address,
                                                       omp_threads_bind
                                                       or envs.cpu_omp_threads_bind(),
                                                       data_parallel))
            self.ready = self._wait_ready(envs.engine_ready_timeout_s())
            self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(self.ready.config.model)
        except BaseException:
            self._close(kill=True)
            raise
        self.checks = RequestChecks(self.ready.config, self.tokenizer)
        self.pid = self._proc.pid

    def _wait_ready(self, timeout_s: float) -> EngineReady:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = self._channel.recv(200)
            code = self._proc.poll()
            if message is None and code is not None:
                message = self._channel.recv(200)  # its last word may precede its exit
                if message is None:
                    raise EngineStartupError(f"the engine process exited ({_exit_status(code)})"
                                             " while loading the model; see the log above")
            if isinstance(message, EngineReady):
                return message
            if isinstance(message, EngineFailed):
                raise EngineStartupError(message.message)
        raise EngineStartupError(f"the engine process did not load the model within "
                                 f"{timeout_s:.0f} s (QWENSERVE_ENGINE_READY_TIMEOUT_S)")

    def start(self, sink: OutputSink) -> None:
        self._channel.start_receiving(deliver_to(sink), "qwenserve-engine-outputs")
        self._watch_thread = threading.Thread(target=self._watch, args=(sink,),
                                              name="qwenserve-engine-watch", daemon=True)
        self._watch_thread.start()

    def send(self, command: Command) -> None:
        self._channel.send(command)  # dropped when the engine is gone: the watch reports it

    def shutdown(self) -> None:
        self._channel.send_last(Shutdown())  # from here on the engine's exit is not a death
        self._close(kill=False)

    def _close(self, kill: bool) -> None:
        self._channel.send_last()
        if self._proc.poll() is None:
            try:
                self._proc.wait(timeout=1 if kill else 30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._channel.close()  # its outputs until the engine exited were delivered
        if self._watch_thread is not None:
            self._watch_thread.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _watch(self, sink: OutputSink) -> None:
        code = self._proc.wait()
        time.sleep(0.2)  # let the engine's own last word (EngineFailed) arrive first
        if self._channel.closing:
            return
        sink.on_dead(f"the engine process (pid {self._proc.pid}) exited unexpectedly "
                     f"({_exit_status(code)})")


def _import_tokenizer_modules() -> None:
    import transformers  # noqa: F401

    import qwenserve.models.tokenizer  # noqa: F401


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


__all__ = ["CoreClient", "EngineDeadError", "EngineStartupError", "OutputSink",
           "ProcCoreClient", "deliver_to"]
