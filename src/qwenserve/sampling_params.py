"""SamplingParams: vLLM's offline sampling parameters, validated with messages that name the fix."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace

from qwenserve.kv_transfer.params import KVTransferParams, parse_kv_transfer_params
from qwenserve.structured_output.params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """How outputs are reported while a request runs (vLLM's names)."""

    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output when the request finishes (offline generate)


@dataclass
class SamplingParams:
    """Sampling parameters for one request, with vLLM's names and defaults.

    ``temperature=0`` means greedy. ``top_k`` of 0 or -1 disables top-k. ``max_tokens=None`` lets a
    request run to ``max_model_len``. ``seed`` makes sampling reproducible independently of the batch.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    best_of: int | None = None
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: max_model_len)
    allowed_token_ids: list[int] | None = None  # sample only these
    bad_words: list[str] | None = None  # never complete one of these words
    # prefill/decode disaggregation (vLLM's request field; docs/disaggregation.md)
    kv_transfer_params: KVTransferParams | None = None
    logit_bias: dict[int, float] | None = None  # added to the logits, as OpenAI's field
    structured_outputs: StructuredOutputsParams | None = None
    thinking_token_budget: int | None = None  # reasoning tokens before </think> is forced
    pooling: bool = False  # a pooling request (--runner pooling): prefilled, never sampled
    # Filled by the engine: the model's EOS ids that also end generation (unless ignore_eos).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine: ``bad_words`` as token ids (with and without a leading space).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # Filled by the server when a reasoning parser is on and the prompt leaves a reasoning block
    # open: structured outputs start after these tokens, and thinking_token_budget forces them.
    reasoning_end_token_ids: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.kv_transfer_params, dict):  # as the API field (or vLLM) spells it
            self.kv_transfer_params = parse_kv_transfer_params(self.kv_transfer_params)
        self._validate()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other truncations cannot change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        # Kept through clone() (dataclasses.replace runs __post_init__ again).
        self.all_stop_token_ids = set(self.stop_token_ids) | set(self.all_stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        if self.best_of is not None:
            _check(self.best_of >= self.n, "best_of", self.best_of, f"must be >= n ({self.n})")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty,
               "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty,
               "must be > 0 (1.0 disables it)")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "must be -1 or 0 (disabled) or a positive integer")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
                   self.max_tokens, "must be an integer >= 1")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", self.logprobs,
                   f"must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None:
            _check(isinstance(self.prompt_logprobs, int)
                   and 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
                   self.prompt_logprobs, f"must be an integer in [0, {MAX_LOGPROBS}]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "must be non-negative integers")
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", self.seed, "must be an integer")
        self._validate_processors()

    def _validate_processors(self) -> None:
        if self.truncate_prompt_tokens is not None:
            _check(isinstance(self.truncate_prompt_tokens, int)
                   and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1),
                   "truncate_prompt_tokens", self.truncate_prompt_tokens,
                   "must be -1 (the model's maximum) or an integer >= 1")
        if self.allowed_token_ids is not None:
            _check(bool(self.allowed_token_ids) and all(
                isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids", self.allowed_token_ids,
                "must be a non-empty list of token ids")
        _check(all(isinstance(w, str) and w for w in self.bad_words or []), "bad_words",
               self.bad_words, "must be non-empty strings")
        for token_id, bias in (self.logit_bias or {}).items():
            _check(isinstance(token_id, int) and token_id >= 0, "logit_bias", token_id,
                   "keys must be token ids")
            _check(-100.0 <= bias <= 100.0, "logit_bias", bias, "values must be in [-100, 100]")
        if self.thinking_token_budget is not None:
            _check(isinstance(self.thinking_token_budget, int)
                   and self.thinking_token_budget >= 0, "thinking_token_budget",
                   self.thinking_token_budget, "must be an integer >= 0")
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputsParams),
                   "structured_outputs", self.structured_outputs,
                   "must be a StructuredOutputsParams")


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")


_ENGINE_FIELDS = ("all_stop_token_ids", "bad_words_token_ids", "reasoning_end_token_ids")
SAMPLING_PARAM_NAMES = tuple(f.name for f in fields(SamplingParams) if f.name not in _ENGINE_FIELDS)
