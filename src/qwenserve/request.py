"""Request: one sequence's state inside the engine core (pure Python, no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from qwenserve.multimodal.inputs import MultiModalInputs
from qwenserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_REMOTE_KVS = 3  # P/D consumer: its prompt's KV is being pulled from a producer
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    """The OpenAI ``finish_reason`` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass
class Request:
    """A sequence being generated.

    Invariant: KV (and recurrent state) is valid for token positions ``[0, num_computed_tokens)``
    of ``all_token_ids``; preemption resets ``num_computed_tokens`` to 0 and keeps the outputs.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None, capped by max_model_len - prompt length
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until scheduled
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # prompt_logprobs requests: entry i scores prompt token i + 1 (plain data from the workers)
    prompt_logprobs: list = field(default_factory=list)
    # speculative decoding: drafts proposed after the last step, verified in the next one
    spec_token_ids: list[int] = field(default_factory=list)
    mm_inputs: MultiModalInputs | None = None  # the prompt's images, if any
    # P/D consumer (``kv_transfer_params.do_remote_prefill``): the prompt's KV comes from a
    # producer once; set when the pull succeeded, until the request is admitted with it.
    kv_pull_done: bool = False
    kv_loaded: bool = False
    kv_transfer_out: dict | None = None  # P/D producer: the answer for the proxy

    @property
    def needs_kv_pull(self) -> bool:
        params = self.sampling_params.kv_transfer_params
        return params is not None and params.remote is not None and not self.kv_pull_done

    def block_extra_key(self, start: int, end: int) -> bytes:
        """What the prefix-cache key of the block of tokens ``[start, end)`` adds to its token
        ids: the content hashes of the images inside it (nothing for text)."""
        return b"" if self.mm_inputs is None else self.mm_inputs.block_extra_key(start, end)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)
