"""What crosses between the server's ``AsyncEngine`` and its engine core (a thread or a process).

Plain dataclasses, pickled with protocol 5 over ZeroMQ in the multiprocess topology. Outputs
are batched: one ``StepOutputs`` per engine step carries every request's new tokens and text,
so the API process wakes once per step, not once per token per request; they are pickled as
flat columns (``output_wire.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from qwenserve.config import EngineConfig
from qwenserve.core.cache.plan import CachePlan
from qwenserve.engine.output_wire import Packed, pack_outputs, unpack_outputs
from qwenserve.metrics.stats import EngineStats
from qwenserve.multimodal.inputs import MultiModalInputs
from qwenserve.outputs import RequestOutput
from qwenserve.sampling_params import SamplingParams


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float  # time.monotonic() (one clock for both processes on one host)
    mm_inputs: MultiModalInputs | None = None  # the prompt's images, processed


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class UtilityCall:
    """Call ``LLMEngine.<name>(*args)`` between steps (e.g. ``reset_prefix_cache``)."""

    call_id: int
    name: str
    args: tuple[int | float | str | bool | None, ...] = ()


@dataclass
class Shutdown:
    pass


Command = AddRequest | AbortRequests | UtilityCall | Shutdown


@dataclass
class UtilityResult:
    call_id: int
    ok: bool
    value: object  # the return value, or the error message when not ``ok``


@dataclass
class StepOutputs:
    """Everything one pass of the engine loop produced."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stats: list[EngineStats] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (request id, why refused)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (request id, why failed)
    results: list[UtilityResult] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.outputs or self.stats or self.errors or self.failures or self.results)

    def __reduce__(self) -> tuple[Callable[..., StepOutputs], tuple[object, ...]]:
        """Pickled with the outputs as columns, without their prompts (``output_wire.py``)."""
        return _unpickle_step, (pack_outputs(self.outputs), self.stats, self.errors,
                                self.failures, self.results)


def _unpickle_step(packed: Packed, stats: list[EngineStats], errors: list[tuple[str, str]],
                   failures: list[tuple[str, str]], results: list[UtilityResult]
                   ) -> StepOutputs:
    return StepOutputs(unpack_outputs(packed), stats, errors, failures, results)


@dataclass
class EngineReady:
    """The engine process loaded the model; what the API process needs to describe it."""

    config: EngineConfig
    plan: CachePlan
    enable_prefix_caching: bool
    device_description: str


@dataclass
class EngineFailed:
    """The engine could not start, or its loop failed: the message is for the user."""

    message: str
