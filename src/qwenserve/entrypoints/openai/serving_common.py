"""What every OpenAI handler shares: the server state, the model check, request -> SamplingParams
(with vLLM's defaults and checks), logprobs formatting, and the one log line per request."""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from qwenserve.entrypoints.openai.admission import Admission
from qwenserve.entrypoints.openai.chat_images import ServerImages
from qwenserve.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    context_length_error,
    from_value_error,
    internal_error,
    model_not_found,
)
from qwenserve.entrypoints.openai.protocol import ChatCompletionRequest, SamplingRequest
from qwenserve.entrypoints.openai.request_fields import refuse_unsupported
from qwenserve.kv_transfer.params import parse_kv_transfer_params
from qwenserve.logger import init_logger
from qwenserve.outputs import Logprob
from qwenserve.sampling_params import RequestOutputKind, SamplingParams
from qwenserve.structured_output.config import StructuredOutputsConfig
from qwenserve.structured_output.service import GrammarService

logger = init_logger("qwenserve.entrypoints.openai")
P = ParamSpec("P")
T = TypeVar("T")

# A prompt longer than this many characters per token of max_model_len cannot fit even after
# truncation; it is refused before tokenizing (tokenizing 30 MB takes tens of seconds).
MAX_CHARS_PER_TOKEN = 32

# vLLM's fallbacks when neither the request nor generation_config.json sets a value.
_NEUTRAL_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


@dataclass
class ServingOptions:
    """Server-side options (the ``Frontend`` flags) the handlers consult."""

    served_model_names: list[str]
    chat_template: str | None = None
    response_role: str = "assistant"
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    trust_request_chat_template: bool = False
    chat_template_content_format: str = "auto"
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    log_requests: bool = True
    max_log_len: int | None = None
    generation_overrides: dict[str, Any] = field(default_factory=dict)
    generation_config: str = "auto"  # --generation-config: auto | vllm | a folder
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    max_sequences_per_request: int = 512  # prompts x n of one request
    max_queued_sequences: int = 4096  # sequences waiting for a batch slot, all requests


class ServerState:
    """The engine plus everything derived from it once at start-up."""

    def __init__(self, engine: Any, options: ServingOptions, model_root: str | None = None) -> None:
        self.engine = engine
        self.options = options
        config = engine.config
        self.model_name = options.served_model_names[0]
        self.model_root = model_root or config.model.name
        self.max_model_len = int(config.scheduler.max_model_len)
        self.max_logprobs = int(getattr(config, "max_logprobs", 20))
        self.vocab_size = int(config.model.vocab_size)
        self.tokenizer = engine.get_tokenizer()
        overrides = dict(options.generation_overrides)
        if "max_new_tokens" in overrides:  # the generation_config.json name, as vLLM takes it
            overrides["max_tokens"] = overrides.pop("max_new_tokens")
        self.generation_defaults = {**config.model.generation_defaults, **overrides}
        # vLLM's rule: with --generation-config auto|vllm the model's max_new_tokens only fills
        # in an unset max_tokens; an --override-generation-config value (or a folder's) caps it.
        self.override_max_tokens = (
            overrides.get("max_tokens")
            if options.generation_config in ("auto", "vllm")
            else self.generation_defaults.get("max_tokens")
        )
        self.created = int(time.time())
        self.draining = False
        # Set once SIGTERM's grace period (--shutdown-timeout) is over: requests still open end
        # with a 503 or an SSE error event instead of being cut.
        self.stopping = asyncio.Event()
        self.admission = Admission(
            options.max_sequences_per_request,
            options.max_queued_sequences,
            int(getattr(config.scheduler, "max_num_seqs", 256)),
        )
        self._counter = itertools.count()
        self._grammars: GrammarService | None = None
        self.images = ServerImages(engine)  # image parts of chats (chat_images.py)
        self._grammars_lock = threading.Lock()  # first use may come from two pool threads
        # Tokenizing and template rendering run here, not on the event loop, so that one big
        # request cannot keep /health and every stream waiting (the tokenizer drops the GIL).
        self._cpu_pool = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="qwenserve-cpu"
        )

    def start_grace_period(self, grace_s: float) -> None:
        """Called on the event loop when SIGTERM/SIGINT arrives."""
        asyncio.get_running_loop().call_later(grace_s, self.stopping.set)

    def abort_reason(self) -> str:
        """What the request log line says when a request ends early."""
        return "abort (server shutting down)" if self.stopping.is_set() else "abort (client left)"

    async def offload(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run CPU-heavy request work (tokenize, render, detokenize) off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._cpu_pool, functools.partial(fn, *args, **kwargs))

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * MAX_CHARS_PER_TOKEN

    def check_prompt_chars(self, text: str, param: str = "prompt") -> None:
        """Refuse text too long to fit before paying for tokenizing it."""
        if len(text) > self.max_prompt_chars:
            raise bad_request(
                f"The prompt is {len(text)} characters long; this server tokenizes at most "
                f"{self.max_prompt_chars} ({MAX_CHARS_PER_TOKEN} characters per token of "
                f"--max-model-len {self.max_model_len}). Shorten the input.",
                param,
            )

    def grammar_service(self) -> GrammarService:
        """The grammar compiler (shared with an in-process engine: one compile per spec)."""
        with self._grammars_lock:
            if self._grammars is None:
                from qwenserve.structured_output.service import model_grammar_service

                self._grammars = model_grammar_service(self.engine.config.model, self.tokenizer)
            return self._grammars

    def check_model(self, model: str | None) -> str:
        """The name to report for ``model``; 404 for a name this server does not serve."""
        if model and model not in self.options.served_model_names:
            raise model_not_found(model)
        return self.model_name

    def request_ids(self, prefix: str, header_id: str | None) -> tuple[str, str]:
        """(id shown to the client, id inside the engine). A client's ``X-Request-Id`` may repeat
        across requests; the engine's id must not, so a counter is appended to it."""
        public = f"{prefix}-{header_id or uuid.uuid4().hex}"
        return public, f"{public}-{next(self._counter)}"

    def check_prompt_ids(self, token_ids: list[int]) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"Token id {bad} is out of vocabulary (size {self.vocab_size})", "prompt"
            )


def check_unsupported(req: SamplingRequest) -> None:
    """Fields qwenserve understands but cannot honour: refuse them rather than ignore."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("Stream options can only be defined when stream=True.", "stream_options")
    refuse_unsupported(req, "chat" if isinstance(req, ChatCompletionRequest) else "completion")


def truncate_prompt(req: SamplingRequest, state: ServerState, token_ids: list[int]) -> list[int]:
    """``truncate_prompt_tokens`` (-1: max_model_len) from ``truncation_side`` (left: keep the
    end of the prompt, as vLLM's default)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return token_ids
    if k == 0:
        raise bad_request("truncate_prompt_tokens must be -1 or >= 1", "truncate_prompt_tokens")
    k = state.max_model_len if k == -1 else k
    return token_ids[:k] if req.truncation_side == "right" else token_ids[-k:]


def _logit_bias(req: SamplingRequest) -> dict[int, float] | None:
    if not req.logit_bias:
        return None
    try:
        return {int(token): float(bias) for token, bias in req.logit_bias.items()}
    except ValueError as e:
        raise bad_request("logit_bias keys must be token ids (integers as strings)",
                          "logit_bias") from e


def resolve_max_tokens(
    state: ServerState, requested: int | None, num_prompt_tokens: int
) -> int | None:
    """vLLM's rule: the smallest of the room left in the context, the request's value (else the
    default ``max_new_tokens``) and an override cap; a request that cannot fit is a 400 with
    both numbers."""
    if num_prompt_tokens >= state.max_model_len or (
        requested is not None
        and requested > 0
        and num_prompt_tokens + requested > state.max_model_len
    ):
        raise context_length_error(state.max_model_len, num_prompt_tokens, requested)
    if requested is not None and requested < 1:
        return requested  # SamplingParams words the error
    room = state.max_model_len - num_prompt_tokens
    fallback = requested if requested is not None else state.generation_defaults.get("max_tokens")
    return min(v for v in (room, fallback, state.override_max_tokens) if v)


def build_sampling_params(
    state: ServerState,
    req: SamplingRequest,
    max_tokens: int | None,
    logprobs: int | None,
    stream: bool,
) -> SamplingParams:
    """Request fields -> SamplingParams; unset values come from generation_config.json
    (``--generation-config auto``), then vLLM's neutral defaults."""
    check_unsupported(req)
    defaults = state.generation_defaults

    def pick(name: str) -> Any:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, _NEUTRAL_DEFAULTS[name])

    for name, value in (("logprobs", logprobs), ("prompt_logprobs", req.prompt_logprobs)):
        if value is not None and value > state.max_logprobs:
            raise bad_request(
                f"{name} {value} is more than the server's max_logprobs ({state.max_logprobs})",
                name,
            )
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and getattr(req, "echo", False):
        prompt_logprobs = logprobs  # vLLM: echo with logprobs scores the echoed prompt too
    try:
        return SamplingParams(
            n=req.n,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty"),
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            logit_bias=_logit_bias(req),
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            kv_transfer_params=parse_kv_transfer_params(req.kv_transfer_params),
        )
    except (ValueError, TypeError) as e:
        raise from_value_error(ValueError(str(e))) from e


def engine_error(error: BaseException) -> OpenAIError:
    """An exception from ``AsyncEngine.generate`` -> the client's error."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, ValueError):
        return from_value_error(error)
    from qwenserve.engine.async_engine import EngineDeadError, RequestFailedError

    if isinstance(error, RequestFailedError):
        logger.error("A request failed: %s", error)
        return OpenAIError(str(error), 503)
    if isinstance(error, EngineDeadError):
        logger.error("A request failed: the engine is not running (%s)", error)
        return OpenAIError("The engine is not running; the server must be restarted", 503)
    return internal_error(logger, "A request failed in the engine", error, 503)


# ---- logprobs ---------------------------------------------------------------------------------
def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(
        ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank > 0),
        key=lambda item: item[1].rank,
    )
    return ranked[:k]


def _token_text(state: ServerState, token_id: int, lp: Logprob) -> str:
    if lp.decoded_token is not None:
        return lp.decoded_token
    return state.tokenizer.decode([token_id])


def chat_logprobs(
    state: ServerState, token_ids: list[int], entries: list[dict[int, Logprob]] | None, top_k: int
) -> dict | None:
    """OpenAI chat format: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if entries is None:
        return None
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        lp = entry[token_id]
        text = _token_text(state, token_id, lp)
        content.append(
            {
                "token": text,
                "logprob": max(lp.logprob, -9999.0),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (t := _token_text(state, tid, tlp)),
                        "logprob": max(tlp.logprob, -9999.0),
                        "bytes": list(t.encode()),
                    }
                    for tid, tlp in _top(entry, top_k)
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    state: ServerState,
    token_ids: list[int],
    entries: list[dict[int, Logprob] | None] | None,
    top_k: int,
    text_offset: int = 0,
) -> dict | None:
    """Legacy completions format: tokens, token_logprobs, top_logprobs, text_offset. The
    sampled token is always among the top entries (so up to ``logprobs + 1``), as OpenAI does.
    An entry of None (the first token of an echoed prompt: nothing precedes it) gives
    ``null`` logprobs, as vLLM and OpenAI do."""
    if entries is None:
        return None
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for token_id, entry in zip(token_ids, entries, strict=False):
        if entry is None:
            text = state.tokenizer.decode([token_id])
            token_logprobs.append(None)
            tops.append(None)
        else:
            lp = entry[token_id]
            text = _token_text(state, token_id, lp)
            token_logprobs.append(max(lp.logprob, -9999.0))
            top = {
                _token_text(state, t, tlp): max(tlp.logprob, -9999.0)
                for t, tlp in _top(entry, top_k)
            }
            top.setdefault(text, max(lp.logprob, -9999.0))
            tops.append(top)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def prompt_logprobs_body(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}``, the scored token first."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): {
                "logprob": max(lp.logprob, -9999.0),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]


# ---- usage and logging ------------------------------------------------------------------------
def usage(
    state: ServerState,
    num_prompt_tokens: int,
    num_completion_tokens: int,
    num_cached_tokens: int = 0,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }
    if state.options.enable_prompt_tokens_details:
        body["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return body


def log_request(
    state: ServerState,
    request_id: str,
    endpoint: str,
    prompt: Any,
    usage_body: dict[str, Any] | None,
    finish: str,
    start_s: float,
) -> None:
    """One INFO line per request (``--disable-log-requests`` turns it off)."""
    if not state.options.log_requests:
        return
    text = repr(prompt)
    limit = state.options.max_log_len
    if limit is not None and len(text) > limit:
        text = text[:limit] + "..."
    tokens = (
        (
            f"prompt_tokens={usage_body['prompt_tokens']}, "
            f"completion_tokens={usage_body['completion_tokens']}, "
        )
        if usage_body
        else ""
    )
    logger.info(
        "Request %s %s: finish_reason=%s, %s%.3f s, prompt: %s",
        request_id,
        endpoint,
        finish,
        tokens,
        time.monotonic() - start_s,
        text,
    )
