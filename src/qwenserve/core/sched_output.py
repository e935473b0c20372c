"""Messages from the scheduler to the workers and back: plain data, built-in types only.

They cross process boundaries under tensor parallelism, so they carry no tensors and no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qwenserve.kv_transfer.params import RemotePrefill
from qwenserve.multimodal.inputs import MultiModalInputs
from qwenserve.outputs import PooledData
from qwenserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen, or one resuming after preemption (state rebuilt)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resuming after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    state_slot: int | None
    mm_inputs: MultiModalInputs | None = None  # the prompt's images (pixels for the encoder)


@dataclass
class ScheduledChunk:
    """The tokens one request computes this step.

    ``token_ids`` sit at positions ``start_pos .. start_pos + len(token_ids) - 1``; a decode is a
    chunk of one token. ``sample`` is true when the chunk reaches the request's last known token,
    so the logits at its end give the next token (an intermediate prefill chunk samples nothing).

    Speculative decoding: the last ``num_draft_tokens`` of ``token_ids`` are draft tokens, not
    yet part of the request; the workers verify them (one row of logits per token) and keep
    the KV of those accepted.

    ``state_checkpoint`` (hybrid models' prefix caching): ``(n, slot)``, the recurrent states
    (conv and SSM) after the chunk's first ``n`` tokens are also written to state slot ``slot``.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    new_block_ids: list[int]
    sample: bool
    num_draft_tokens: int = 0
    state_checkpoint: tuple[int, int] | None = None


@dataclass
class KVPull:
    """P/D consumer: fetch ``remote``'s blocks into this request's ``block_ids`` (in order),
    in the background; the workers report the outcome in ``ModelOutput.kv_pulls_done``."""

    request_id: str
    block_ids: list[int]
    remote: RemotePrefill
    state_slot: int | None = None  # hybrid models: the request's slot, for the pulled state


@dataclass
class KVHold:
    """P/D producer: a finished request whose blocks stay allocated until a consumer pulls
    them (``ModelOutput.kv_sent``) or the hold times out."""

    request_id: str
    block_ids: list[int]
    state_slot: int | None = None  # hybrid models: the recurrent state before the last token


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)  # batch order
    finished_request_ids: list[str] = field(default_factory=list)  # drop their worker state
    preempted_request_ids: list[str] = field(default_factory=list)
    # Recurrent-state copies (source slot, destination slot) of hybrid models' prefix cache,
    # made before the forward pass: saves first (a live slot, still holding the state after the
    # previous step's chunk, -> a checkpoint), then restores (checkpoint -> a request's slot).
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    # Prefill/decode disaggregation (kv_transfer/): pulls to start, holds to serve, holds
    # whose blocks the scheduler took back (timed out) and that must no longer be served.
    kv_pulls: list[KVPull] = field(default_factory=list)
    kv_holds: list[KVHold] = field(default_factory=list)
    kv_releases: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SampledToken:
    """What the sampler produced for one request at the end of its chunk."""

    token_id: int
    logprob: float | None = None  # of the sampled token, when logprobs were asked for
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first


@dataclass
class RequestUpdate:
    """What one step did to one request, for the engine's output processing: its new token,
    and how it finished (``finish_reason`` "stop" | "length" | "abort", None while running).
    A pooling request finishes with its ``pooled`` output and no token."""

    request_id: str
    new_token: SampledToken | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int  # prompt tokens found in the prefix cache (-1: not admitted yet)
    first_scheduled_time: float | None  # wall clock
    prompt_logprobs: list[SampledToken] | None = None  # with its first token, when asked for
    pooled: PooledData | None = None  # --runner pooling: the prompt's pooled output
    kv_transfer_params: dict | None = None  # P/D producer: where its prompt's KV waits

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ModelOutput:
    """Rank 0's answer to a SchedulerOutput: one sample per chunk with ``sample=True``."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    # Speculative decoding: the draft tokens verified as accepted, which come before
    # ``sampled`` (absent when none was), and the drafts proposed for each request's next step.
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # prompt_logprobs requests: request id -> (first position, one entry per position from it).
    # The entry at position p scores prompt token p + 1 (its ``token_id``) given tokens 0..p.
    prompt_logprobs: dict[str, tuple[int, list[SampledToken]]] = field(default_factory=dict)
    # pooling runner (--runner pooling): request id -> its pooled output, instead of a sample
    pooled: dict[str, PooledData] = field(default_factory=dict)
    # Prefill/decode disaggregation: pulls that ended since the last step (request id -> None
    # when the KV arrived, else why not), and held requests a consumer has pulled.
    kv_pulls_done: dict[str, str | None] = field(default_factory=dict)
    kv_sent: list[str] = field(default_factory=list)
