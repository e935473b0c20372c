"""ThreadCoreClient: the engine core on a background thread of the API process.

The debugging topology (``QWENSERVE_ENABLE_MULTIPROCESSING=0``): one process, so a debugger
or profiler sees everything, at the cost of sharing the GIL with the event loop.
"""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING

from qwenserve.engine.core import EngineCore
from qwenserve.engine.core_client import OutputSink
from qwenserve.engine.core_messages import Command, Shutdown
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.logger import init_logger

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = init_logger(__name__)


class ThreadCoreClient:
    engine_indexes: tuple[int, ...] = (0,)

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._core = EngineCore(engine)
        self.ready = self._core.ready_message()
        self.checks = engine.checks
        self.tokenizer: PreTrainedTokenizerBase = engine.tokenizer
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, sink: OutputSink) -> None:
        self._thread = threading.Thread(target=self._run, args=(sink,), name="qwenserve-engine",
                                        daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        self._inbox.put(command)

    def shutdown(self) -> None:
        self.send(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.engine.shutdown()

    def _run(self, sink: OutputSink) -> None:
        try:
            while self._apply_commands(block=not self._core.has_work()):
                out = self._core.run_once()
                if out:
                    sink.on_step(out)
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine: report it
            logger.exception("The engine loop failed; the server is now unhealthy")
            sink.on_dead(f"the engine failed: {type(e).__name__}: {e}")

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting up to a second for one when idle); False to stop."""
        try:
            command = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while self._core.apply(command):
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True
        return False
