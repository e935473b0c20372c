"""AsyncEngine: the server's asyncio face of the engine, one asyncio queue per request.

    asyncio handlers --(AddRequest / AbortRequests / UtilityCall)--> engine core
    asyncio handlers <--(one StepOutputs per engine step)----------- engine core

The engine core runs in its own process by default (``core_client.py`` <-> ``core_proc.py``,
over ZeroMQ), so the model's OpenMP threads and the event loop do not share one GIL; or on a
thread of this process (``core_thread.py``; ``QWENSERVE_ENABLE_MULTIPROCESSING=0``) for
debugging. Each step's outputs reach the event loop in one wake-up. A request whose consumer
goes away (client disconnect, cancelled task) is aborted and its KV blocks are freed at the next
step boundary. When the engine dies, every pending call fails at once with ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from qwenserve import envs
from qwenserve.config import EngineConfig
from qwenserve.core.cache.plan import CachePlan
from qwenserve.engine.arg_utils import EngineArgs
from qwenserve.engine.core_client import CoreClient, EngineDeadError, ProcCoreClient
from qwenserve.engine.core_messages import (
    AbortRequests,
    AddRequest,
    StepOutputs,
    UtilityCall,
)
from qwenserve.engine.core_thread import ThreadCoreClient
from qwenserve.engine.dp_config import DataParallelConfig
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.logger import init_logger
from qwenserve.metrics.stats import EngineStats, IterationStats
from qwenserve.multimodal.inputs import MultiModalInputs
from qwenserve.outputs import CompletionOutput, RequestOutput
from qwenserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = init_logger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "RequestFailedError"]


class RequestFailedError(RuntimeError):
    """A request the engine accepted could not be completed (a P/D consumer's KV pull failed);
    the engine itself is fine."""

_Item = RequestOutput | BaseException


class AsyncEngine:
    def __init__(self, core: CoreClient, stat_loggers: list[Any] | None = None) -> None:
        self.core = core
        self.stat_loggers = list(stat_loggers or [])
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[_Item]]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[object]]] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self.dead_error: EngineDeadError | None = None
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._last_stats: dict[int, EngineStats] = {}  # by engine (data-parallel rank)
        core.start(self)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[Any] | None = None,
                         multiprocess: bool | None = None,
                         data_parallel: DataParallelConfig | None = None) -> AsyncEngine:
        """The engine core in its own process unless ``multiprocess`` is False (default: the
        ``QWENSERVE_ENABLE_MULTIPROCESSING`` setting); with ``data_parallel`` over one rank,
        one process per local rank behind ``DPCoreClient``."""
        return cls(start_core_client(args, multiprocess, data_parallel), stat_loggers)

    # ---- what the server reads at start-up ----------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.core.ready.config

    @property
    def plan(self) -> CachePlan:
        return self.core.ready.plan

    @property
    def enable_prefix_caching(self) -> bool:
        return self.core.ready.enable_prefix_caching

    @property
    def device_description(self) -> str:
        return self.core.ready.device_description

    @property
    def multiprocess(self) -> bool:
        return not isinstance(self.core, ThreadCoreClient)

    @property
    def engine_indexes(self) -> tuple[int, ...]:
        """The engines' ``engine`` labels: their data-parallel ranks (``(0,)`` with one)."""
        return self.core.engine_indexes

    @property
    def engine(self) -> LLMEngine:
        """The in-process LLMEngine (thread topology only: for tests and debugging)."""
        if not isinstance(self.core, ThreadCoreClient):
            raise RuntimeError("the engine runs in its own process; set "
                               "QWENSERVE_ENABLE_MULTIPROCESSING=0 to reach it in-process")
        return self.core.engine

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.core.tokenizer

    @property
    def is_running(self) -> bool:
        return self.dead_error is None

    def add_dead_callback(self, fn: Callable[[EngineDeadError], None]) -> None:
        """Call ``fn`` (on a background thread) once the engine has died."""
        with self._lock:
            dead = self.dead_error
            if dead is None:
                self._dead_callbacks.append(fn)
        if dead is not None:
            fn(dead)

    # ---- requests -----------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, prompt: str | None = None,
                       mm_inputs: MultiModalInputs | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; raises ``ValueError`` at once for a
        request the engine would refuse, and ``EngineDeadError`` if the engine dies."""
        self._check_alive()
        self.core.checks.check_images(prompt_token_ids, mm_inputs, params)
        self.core.checks.validate_request(prompt_token_ids, params)
        out_queue: asyncio.Queue[_Item] = asyncio.Queue()
        with self._lock:
            self._check_alive()
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._queues[request_id] = (asyncio.get_running_loop(), out_queue)
        finished = False
        engine_prompt_ids = self.core.checks.truncate_prompt(prompt_token_ids, params)
        try:
            self.core.send(AddRequest(request_id, prompt_token_ids, params, prompt,
                                      time.monotonic(), mm_inputs))
            while not finished:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                item = _coalesce(item, out_queue, params.output_kind)
                if not item.prompt_token_ids:  # it crossed without them (output_wire.py)
                    item.prompt, item.prompt_token_ids = prompt, engine_prompt_ids
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self.dead_error is None:
            self.core.send(AbortRequests([request_id]))

    async def call_utility(self, name: str, *args: int | float | str | bool | None) -> object:
        """Run ``LLMEngine.<name>(*args)`` in the engine between steps and return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()
        call_id = next(self._call_ids)
        with self._lock:
            self._check_alive()
            self._calls[call_id] = (loop, future)
        self.core.send(UtilityCall(call_id, name, tuple(args)))
        return await future

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.call_utility("reset_prefix_cache"))

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
        self.core.shutdown()

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))

    # ---- the engine core's side (called on its receiving thread) -------------------------------
    def on_step(self, step: StepOutputs) -> None:
        """Hand one step's outputs to their requests' queues: one wake-up per event loop."""
        for stats in step.stats:
            self._record(stats)
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]] = {}
        with self._lock:
            for out in step.outputs:
                target = self._queues.get(out.request_id)
                if target is not None:
                    batches.setdefault(target[0], []).append((target[1], out))
            for request_id, message in step.errors:
                target = self._queues.get(request_id)
                if target is not None:
                    batches.setdefault(target[0], []).append((target[1], ValueError(message)))
            for request_id, message in step.failures:
                target = self._queues.get(request_id)
                if target is not None:
                    batches.setdefault(target[0], []).append(
                        (target[1], RequestFailedError(message)))
            settled = [(self._calls.pop(r.call_id, None), r.ok, r.value) for r in step.results]
        for loop, items in batches.items():
            _call_soon(loop, _put_all, items)
        for call, ok, value in settled:
            if call is not None:
                result = value if ok else RuntimeError(str(value))
                _call_soon(call[0], _settle, call[1], ok, result)

    def on_dead(self, message: str) -> None:
        """The engine died: fail every pending request and call, zero the gauges, tell the
        server (which exits unless told to keep alive)."""
        error = EngineDeadError(message)
        with self._lock:
            if self.dead_error is not None:
                return
            self.dead_error = error
            queues = list(self._queues.values())
            calls = list(self._calls.values())
            self._calls.clear()
            callbacks = list(self._dead_callbacks)
        logger.error("The engine died: %s", message)
        for loop, out_queue in queues:
            _call_soon(loop, out_queue.put_nowait, error)
        for loop, future in calls:
            _call_soon(loop, _settle, future, False, error)
        for index in self.engine_indexes:
            last = self._last_stats.get(index)
            self._record(EngineStats(0, 0, 0.0, last.prefix_cache_queries if last else 0,
                                     last.prefix_cache_hits if last else 0,
                                     last.num_preemptions if last else 0, IterationStats(),
                                     index))
        for fn in callbacks:
            fn(error)

    def _record(self, stats: EngineStats) -> None:
        self._last_stats[stats.engine_index] = stats
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats)


def _coalesce(item: RequestOutput, out_queue: asyncio.Queue[_Item],
              kind: RequestOutputKind) -> RequestOutput:
    """A consumer that fell behind gets everything queued for it as one output (one SSE chunk),
    not one per step: deltas are concatenated, a cumulative output replaces the older ones."""
    while not out_queue.empty() and kind != RequestOutputKind.FINAL_ONLY:
        following = out_queue._queue[0]  # type: ignore[attr-defined]  # peek: an error stays
        if isinstance(following, BaseException):
            break
        out_queue.get_nowait()
        item = following if kind == RequestOutputKind.CUMULATIVE else merge_deltas(item,
                                                                                   following)
    return item


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive delta outputs of one request as one."""
    merged = {c.index: c for c in first.outputs}
    for c in then.outputs:
        prev = merged.get(c.index)
        if prev is None:
            merged[c.index] = c
            continue
        logprobs = None
        if prev.logprobs is not None or c.logprobs is not None:
            logprobs = [*(prev.logprobs or []), *(c.logprobs or [])]
        merged[c.index] = CompletionOutput(c.index, prev.text + c.text,
                                           [*prev.token_ids, *c.token_ids],
                                           c.cumulative_logprob, logprobs, c.finish_reason,
                                           c.stop_reason)
    return dataclasses.replace(
        then, outputs=[merged[i] for i in sorted(merged)],
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None
        else then.prompt_logprobs,
        num_cached_tokens=max(first.num_cached_tokens, then.num_cached_tokens),
        extra={**first.extra, **then.extra})


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that loop has closed: nobody is waiting there any more
        pass


def _put_all(items: list[tuple[asyncio.Queue[_Item], _Item]]) -> None:
    for out_queue, item in items:
        out_queue.put_nowait(item)


def _settle(future: asyncio.Future[object], ok: bool, value: object) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        assert isinstance(value, BaseException)
        future.set_exception(value)


def start_core_client(args: EngineArgs, multiprocess: bool | None = None,
                      data_parallel: DataParallelConfig | None = None) -> CoreClient:
    """The topology the options ask for (see ``AsyncEngine.from_engine_args``), started."""
    if multiprocess is None:
        multiprocess = envs.enable_multiprocessing()
    if data_parallel is not None and data_parallel.size > 1:
        if not multiprocess:
            raise ValueError("data parallelism runs each engine in its own process: unset "
                             "QWENSERVE_ENABLE_MULTIPROCESSING=0")
        from qwenserve.engine.dp_client import start_dp_client

        return start_dp_client(args, data_parallel)
    if multiprocess:
        return ProcCoreClient(args)
    return ThreadCoreClient(LLMEngine.from_engine_args(args))
