"""AsyncEngine: the engine loop in a background thread, one asyncio queue per request.

    asyncio handlers --(commands: add / abort)--> inbox --> engine thread: step() in a loop
    asyncio handlers <--(RequestOutput deltas)--- per-request queues (call_soon_threadsafe)

torch releases the GIL inside its kernels, so the event loop keeps serving HTTP while a step
runs. A request whose consumer goes away (client disconnect, cancelled task) is aborted and its
KV blocks are freed at the next step boundary.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from qwenserve.engine.arg_utils import EngineArgs
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.multimodal.inputs import MultiModalInputs
from qwenserve.logger import init_logger
from qwenserve.outputs import RequestOutput
from qwenserve.sampling_params import SamplingParams

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; the server must report unhealthy and restart."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float
    mm_inputs: MultiModalInputs | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn`` on the engine thread (the only thread that may touch the engine's state)."""

    fn: Any
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="qwenserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[Any] | None = None
                         ) -> AsyncEngine:
        return cls(LLMEngine.from_engine_args(args, stat_loggers=stat_loggers))

    # ---- the asyncio side ---------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead_error is None

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def config(self) -> Any:
        return self.engine.config

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, prompt: str | None = None,
                       mm_inputs: MultiModalInputs | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; raises ``ValueError`` at once for a
        request the engine would refuse, and ``EngineDeadError`` if the engine fails."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self.dead_error
        self.engine.check_images(prompt_token_ids, mm_inputs, params)
        self.engine.validate_request(prompt_token_ids, params)
        out_queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._queues[request_id] = (asyncio.get_running_loop(), out_queue)
        self._send(_Add(request_id, prompt_token_ids, params, prompt, time.monotonic(),
                        mm_inputs))
        finished = False
        try:
            while not finished:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    async def call_in_engine(self, fn: Any) -> Any:
        """Run ``fn()`` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._send(_Call(fn, loop, future))
        return await future

    async def reset_prefix_cache(self) -> bool:
        return await self.call_in_engine(self.engine.reset_prefix_cache)

    def num_unfinished_requests(self) -> int:
        with self._lock:
            return len(self._queues)

    async def wait_until_idle(self, timeout_s: float) -> bool:
        """Wait for running requests to finish (graceful shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.num_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.num_unfinished_requests() == 0

    def shutdown(self) -> None:
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    def _send(self, command: Any) -> None:
        self._inbox.put(command)
        self._wakeup.set()

    # ---- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        idle_reported = True
        try:
            while not self._stop.is_set():
                if self._apply_commands():
                    idle_reported = False
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                    idle_reported = False
                else:
                    if not idle_reported:  # aborts freed blocks and no step will report it
                        self.engine.record_idle_stats()
                        idle_reported = True
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine: report it
            logger.exception("The engine loop failed; the server is now unhealthy")
            self.dead_error = e
            error = EngineDeadError(f"the engine failed: {type(e).__name__}: {e}")
            with self._lock:
                request_ids = list(self._queues)
            for request_id in request_ids:
                self._deliver(request_id, error)

    def _apply_commands(self) -> bool:
        """Apply queued commands; True if any changed the engine's state."""
        changed = False
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return changed
            changed = True
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                continue
            if isinstance(command, _Call):
                self._run_call(command)
                continue
            with self._lock:
                wanted = command.request_id in self._queues
            if not wanted:  # the client left before the request reached the engine
                continue
            try:
                self.engine.add_request(command.request_id, command.prompt_token_ids,
                                        command.params, command.prompt, command.arrival_time,
                                        command.mm_inputs)
            except ValueError as e:
                self._deliver(command.request_id, e)

    @staticmethod
    def _run_call(command: _Call) -> None:
        try:
            result: Any = command.fn()
            setter = command.future.set_result
        except Exception as e:  # noqa: BLE001 - handed to the caller
            result, setter = e, command.future.set_exception

        def settle() -> None:
            if not command.future.done():
                setter(result)

        command.loop.call_soon_threadsafe(settle)

    def _deliver(self, request_id: str, item: Any) -> None:
        with self._lock:
            target = self._queues.get(request_id)
        if target is not None:
            loop, out_queue = target
            loop.call_soon_threadsafe(out_queue.put_nowait, item)
