"""Output objects with vLLM's names and fields (``RequestOutput``, ``CompletionOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field

# A pooling request's output: one vector (embed, classify) or one row per prompt token (reward)
PooledData = list[float] | list[list[float]]

@dataclass
class Logprob:
    """Log-probability of one token, its rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing precedes it), then as SampleLogprobs.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a request (there are ``n`` per request)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (``time.time()`` seconds) and counters of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """The output of one request, as ``vllm.RequestOutput``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # --runner pooling: embedding or score logits; reward: one row per prompt token
    pooled: PooledData | None = None
    kv_transfer_params: dict | None = None  # P/D producer: where the prompt's KV waits
    extra: dict = field(default_factory=dict)
