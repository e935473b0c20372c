"""EngineCore: the engine loop the server runs, on a thread or in its own process.

    commands (add / abort / utility call) -> apply() -> LLMEngine
    run_once(): one LLMEngine.step() -> one StepOutputs (outputs, stats, refusals, call results)

The loop itself (where commands come from, where outputs go) belongs to the topology:
``core_thread.py`` or ``core_proc.py``.
"""

from __future__ import annotations

from qwenserve.engine.core_messages import (
    AbortRequests,
    AddRequest,
    Command,
    EngineReady,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityResult,
)
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.metrics.stats import EngineStats

# LLMEngine methods a UtilityCall may name.
UTILITIES = frozenset({"reset_prefix_cache", "get_num_unfinished_requests",
                       "has_unfinished_requests"})


class _StatsCollector:
    """The engine's stat logger: keeps each step's stats for the next StepOutputs."""

    def __init__(self) -> None:
        self.stats: list[EngineStats] = []

    def record(self, stats: EngineStats) -> None:
        self.stats.append(stats)


class EngineCore:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._collector = _StatsCollector()
        engine.stat_loggers.append(self._collector)
        self._pending = StepOutputs()
        self._idle_reported = True

    def ready_message(self) -> EngineReady:
        return EngineReady(self.engine.config, self.engine.plan,
                           self.engine.cache.enable_prefix_caching,
                           self.engine.executor.describe_device())

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests() or not self._idle_reported

    def apply(self, command: Command) -> bool:
        """Apply one command; False for ``Shutdown``."""
        if isinstance(command, Shutdown):
            return False
        self._idle_reported = False
        if isinstance(command, AbortRequests):
            self.engine.abort_request(command.request_ids)
        elif isinstance(command, UtilityCall):
            self._pending.results.append(self._call(command))
        elif isinstance(command, AddRequest):
            try:
                self.engine.add_request(command.request_id, command.prompt_token_ids,
                                        command.params, command.prompt, command.arrival_time,
                                        command.mm_inputs)
            except ValueError as e:
                self._pending.errors.append((command.request_id, str(e)))
        return True

    def _call(self, call: UtilityCall) -> UtilityResult:
        if call.name not in UTILITIES:
            return UtilityResult(call.call_id, False, f"{call.name!r} is not an engine utility")
        try:
            return UtilityResult(call.call_id, True, getattr(self.engine, call.name)(*call.args))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            return UtilityResult(call.call_id, False, f"{type(e).__name__}: {e}")

    def has_step_to_run(self) -> bool:
        """A step (one pass through the executor) is due here: requests, or KV holds to serve."""
        return self.engine.has_unfinished_requests() or self.engine.has_kv_holds()

    def run_once(self, step_with_peers: bool = False) -> StepOutputs:
        """One step if any request is unfinished; else report idle gauges once (aborts of the
        last requests freed blocks and no step will report it). Returns what to send.

        ``step_with_peers``: other data-parallel replicas step now (DP x EP, ``dp_lockstep.py``),
        so an idle replica runs a dummy step. Either way at most one forward pass (a step with
        nothing scheduled still runs the MoE exchanges there)."""
        if self.engine.has_unfinished_requests():
            self._pending.outputs.extend(self.engine.step())
        elif self.engine.has_kv_holds():  # registers new holds, frees pulled ones
            self._pending.outputs.extend(self.engine.step())
            self._idle_reported = True  # no busy loop: the next look comes with a command or 1 s
        elif step_with_peers:
            self.engine.execute_dummy_batch()
            if not self._idle_reported:
                self.engine.record_idle_stats()
                self._idle_reported = True
        elif not self._idle_reported:
            self.engine.record_idle_stats()
            self._idle_reported = True
        self._pending.failures.extend(self.engine.take_failures())
        out, self._pending = self._pending, StepOutputs()
        out.stats.extend(self._collector.stats)
        self._collector.stats.clear()
        return out
