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
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Protocol

import zmq

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
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the engine drains it
        self._output.setsockopt(zmq.RCVHWM, 0)
        input_address = f"ipc://{self._dir}/input"
        output_address = f"ipc://{self._dir}/output"
        self._input.bind(input_address)
        self._output.bind(output_address)
        self._send_lock = threading.Lock()
        self._closing = False
        self._threads: list[threading.Thread] = []
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
            if self._output.poll(200):
                message = pickle.loads(self._output.recv())
                if isinstance(message, EngineReady):
                    return message
                if isinstance(message, EngineFailed):
                    raise EngineStartupError(message.message)
            code = self._proc.poll()
            if code is not None and not self._output.poll(200):
                raise EngineStartupError(f"the engine process exited ({_exit_status(code)}) "
                                         "while loading the model; see the log above")
        raise EngineStartupError(f"the engine process did not load the model within "
                                 f"{timeout_s:.0f} s (QWENSERVE_ENGINE_READY_TIMEOUT_S)")

    def start(self, sink: OutputSink) -> None:
        for target, name in ((self._receive, "qwenserve-engine-outputs"),
                             (self._watch, "qwenserve-engine-watch")):
            thread = threading.Thread(target=target, args=(sink,), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def send(self, command: Command) -> None:
        payload = pickle.dumps(command, protocol=5)
        with self._send_lock:
            if self._closing:
                return
            try:
                self._input.send(payload, zmq.NOBLOCK)
            except zmq.Again:  # the engine process is gone; the watch reports it
                pass

    def shutdown(self) -> None:
        payload = pickle.dumps(Shutdown(), protocol=5)
        with self._send_lock:  # closing from here on: the engine's exit is not a death
            if not self._closing:
                self._closing = True
                try:
                    self._input.send(payload, zmq.NOBLOCK)
                except zmq.Again:
                    pass
        self._close(kill=False)

    def _close(self, kill: bool) -> None:
        with self._send_lock:
            self._closing = True
        if self._proc.poll() is None:
            try:
                self._proc.wait(timeout=1 if kill else 30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- background threads -------------------------------------------------------------------
    def _receive(self, sink: OutputSink) -> None:
        while not self._closing:
            try:
                if not self._output.poll(500):
                    continue
                message = pickle.loads(self._output.recv())
            except zmq.ZMQError:  # the context was closed under us: shutting down
                return
            if isinstance(message, StepOutputs):
                sink.on_step(message)
            elif isinstance(message, EngineFailed):
                sink.on_dead(message.message)

    def _watch(self, sink: OutputSink) -> None:
        code = self._proc.wait()
        time.sleep(0.2)  # let the engine's own last word (EngineFailed) arrive first
        if self._closing:
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
           "ProcCoreClient"]
