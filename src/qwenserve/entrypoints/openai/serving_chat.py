"""``POST /v1/chat/completions``: template, generate, then split reasoning and tool calls.

The same per-choice parser chain turns model text into message fields whether the answer is
streamed or not (a whole answer is one final delta), so both modes give the same result:

    model text --ReasoningParser--> reasoning | content --ToolParser--> content | tool_calls
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from qwenserve.entrypoints.chat_utils import (
    ChatMessageError,
    ChatTemplateError,
    normalize_messages,
    render_chat,
)
from qwenserve.entrypoints.media_parts import ImageSource
from qwenserve.entrypoints.openai.errors import OpenAIError, bad_request
from qwenserve.entrypoints.openai.protocol import ChatCompletionRequest
from qwenserve.entrypoints.openai.reasoning import REASONING_PARSERS
from qwenserve.entrypoints.openai.serving_common import (
    ServerState,
    build_sampling_params,
    chat_logprobs,
    engine_error,
    log_request,
    prompt_logprobs_body,
    resolve_max_tokens,
    truncate_prompt,
    usage,
)
from qwenserve.entrypoints.openai.structured import apply_constraints, forced_tool_name
from qwenserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ToolCallDelta,
    ToolParser,
    merge_deltas,
)
from qwenserve.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolsParser
from qwenserve.multimodal.inputs import MultiModalInputs
from qwenserve.outputs import CompletionOutput, RequestOutput
from qwenserve.sampling_params import SamplingParams

# apply_chat_template's own arguments: a request's chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "chat_template",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass
class ChatJob:
    request: ChatCompletionRequest
    public_id: str
    engine_id: str
    model: str
    prompt_text: str
    prompt_ids: list[int]
    params: SamplingParams
    parse_tools: bool
    created: int
    start_s: float
    constraint_source: str | None = None  # the field that constrains the output, if any
    mm_inputs: MultiModalInputs | None = None  # the prompt's images, processed


def _check_tool_choice(state: ServerState, req: ChatCompletionRequest) -> bool:
    """Validate tools/tool_choice as vLLM does; True when the configured parser reads calls.
    (``"required"`` and a named function need no parser: a grammar forces the calls.)"""
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if not req.tools or choice not in (None, "auto"):
        return False
    if not (state.options.enable_auto_tool_choice and state.options.tool_call_parser):
        raise bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and '
            "--tool-call-parser to be set",
            "tool_choice",
        )
    return True


def _template_kwargs(state: ServerState, req: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = {**state.options.default_chat_template_kwargs, **(req.chat_template_kwargs or {})}
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    return {k: v for k, v in kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}


def render_prompt(
    state: ServerState,
    messages: list[Any],
    *,
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[Any] | None,
    template_kwargs: dict[str, Any],
    documents: list[dict] | None = None,
    images: list[ImageSource] | None = None,
) -> str:
    """Messages -> prompt text with the request's, the server's or the model's template. Image
    parts become the model's placeholder and are appended to ``images`` (None: refused)."""
    if chat_template is not None and not state.options.trust_request_chat_template:
        raise bad_request(
            "Chat template is passed with request, but "
            "--trust-request-chat-template is not set. Refused request with "
            "untrusted chat template.",
            "chat_template",
        )
    if continue_final_message and add_generation_prompt:
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    fmt = "openai" if state.options.chat_template_content_format == "openai" else "string"
    try:
        dicts = [m.model_dump(exclude_none=True) for m in messages]
        chat = state.images.extract(dicts, fmt)
        if chat.images and images is None:
            raise ChatMessageError("image parts are not supported here; send them to "
                                   "/v1/chat/completions", chat.images[0].param)
        if images is not None:
            images.extend(chat.images)
        dicts = normalize_messages(chat.messages, fmt)
        if documents:
            template_kwargs = {**template_kwargs, "documents": documents}
        return render_chat(
            state.tokenizer,
            dicts,
            chat_template or state.options.chat_template,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
    except ChatMessageError as e:
        raise bad_request(str(e), e.param) from e
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from e


def prepare_chat(state: ServerState, req: ChatCompletionRequest,
                 request_id: str | None) -> ChatJob:
    model = state.check_model(req.model)
    parse_tools = _check_tool_choice(state, req)
    if req.top_logprobs is not None and req.top_logprobs < 0:
        raise bad_request("`top_logprobs` must be a positive value.", "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise bad_request(
            "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
        )
    if req.echo:
        raise bad_request("echo is not supported by qwenserve's chat endpoint yet", "echo")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    images: list[ImageSource] = []
    text = render_prompt(
        state,
        req.messages,
        chat_template=req.chat_template,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        tools=tools,
        template_kwargs=_template_kwargs(state, req),
        documents=req.documents,
        images=images,
    )
    state.check_prompt_chars(text, "messages")
    ids = state.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    # On the CPU pool (``state.offload``): fetching, decoding and processing block here.
    ids, mm_inputs = state.images.expand(images, ids, req.mm_processor_kwargs)
    if mm_inputs is not None and req.truncate_prompt_tokens is not None:
        raise bad_request("truncate_prompt_tokens cannot be used with images (it could cut an "
                          "image's tokens)", "truncate_prompt_tokens")
    ids = truncate_prompt(req, state, ids)
    if not ids:
        raise bad_request("The chat template rendered an empty prompt", "messages")
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    max_tokens = resolve_max_tokens(state, requested, len(ids))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = build_sampling_params(state, req, max_tokens, logprobs, bool(req.stream))
    source = apply_constraints(state, req, params, text)
    public_id, engine_id = state.request_ids("chatcmpl", req.request_id or request_id)
    return ChatJob(
        req,
        public_id,
        engine_id,
        model,
        text,
        ids,
        params,
        parse_tools,
        int(time.time()),
        time.monotonic(),
        source,
        mm_inputs,
    )


class ChoiceParser:
    """Reasoning and tool-call parsing of one choice (``n`` choices -> ``n`` parsers)."""

    def __init__(self, state: ServerState, job: ChatJob) -> None:
        name = state.options.reasoning_parser
        self.reasoning = REASONING_PARSERS[name](job.prompt_text) if name else None
        self.tools = _tool_parser(state, job)
        self.include_reasoning = job.request.include_reasoning
        self.named_tool = forced_tool_name(job.request) is not None
        # parallel_tool_calls=false under "auto": the first call only (a grammar enforces it
        # for "required").
        self.max_calls = 1 if job.request.parallel_tool_calls is False else None

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """Model text -> the message fields it settles (a streamed ``delta``)."""
        delta, calls = self._parse(text, final)
        if calls:
            delta["tool_calls"] = [c.to_openai() for c in calls]
        return delta

    def whole(self, text: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A whole answer: (message fields but tool calls, whole tool calls)."""
        delta, calls = self._parse(text, final=True)
        return delta, merge_deltas(calls)

    def _parse(self, text: str, final: bool) -> tuple[dict[str, Any], list[ToolCallDelta]]:
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
            if self.max_calls is not None:
                calls = [c for c in calls if c.index < self.max_calls]
        delta: dict[str, Any] = {}
        if reasoning and self.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if content or not self.active:
            delta["content"] = content
        return delta, calls

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" when calls were made, except for a named function (OpenAI: "stop")."""
        called = self.num_calls and not self.named_tool
        return "tool_calls" if called and reason is not None else reason


def _tool_parser(state: ServerState, job: ChatJob) -> ToolParser | None:
    """The forced-shape parser for tool_choice required/named, else the configured one."""
    name = forced_tool_name(job.request)
    if name is not None:
        return NamedToolParser(name)
    if job.request.tool_choice == "required" and job.request.tools:
        return RequiredToolsParser()
    tool_name = state.options.tool_call_parser
    if not job.parse_tools or not tool_name:
        return None
    return TOOL_PARSERS[tool_name]([t.model_dump(exclude_none=True) for t in job.request.tools])


def _message(state: ServerState, job: ChatJob, comp: CompletionOutput) -> tuple[dict, str]:
    parser = ChoiceParser(state, job)
    delta, calls = parser.whole(comp.text)
    reasoning = delta.get("reasoning")
    if (
        reasoning is None
        and parser.reasoning is not None
        and parser.reasoning.saw_reasoning
        and parser.include_reasoning
    ):
        reasoning = ""
    content = delta.get("content")
    message = {
        "role": state.options.response_role,
        "content": content if content or not parser.active else None,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": calls,
        "reasoning": reasoning,
        "reasoning_content": reasoning,
    }
    return message, parser.finish_reason(comp.finish_reason) or "stop"


def log_chat(state: ServerState, job: ChatJob, usage_body: Any, finish: str) -> None:
    log_request(
        state,
        job.public_id,
        "/v1/chat/completions",
        job.prompt_text,
        usage_body,
        finish,
        job.start_s,
    )


def _choice(state: ServerState, job: ChatJob, comp: CompletionOutput) -> dict[str, Any]:
    message, finish = _message(state, job, comp)
    logprobs = chat_logprobs(state, comp.token_ids, comp.logprobs, job.request.top_logprobs or 0)
    return {
        "index": comp.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish,
        "stop_reason": comp.stop_reason,
    }


async def chat_complete(
    state: ServerState, job: ChatJob, agen: AsyncIterator[RequestOutput]
) -> dict[str, Any]:
    """The non-streaming response (``agen`` yields one final output)."""
    final: RequestOutput | None = None
    try:
        async for out in agen:
            final = out
    except asyncio.CancelledError:
        log_chat(state, job, None, state.abort_reason())
        raise
    except Exception as e:
        log_chat(state, job, None, "error")
        raise engine_error(e) from e
    if final is None:
        raise OpenAIError("The engine returned no output", 500)
    choices = [_choice(state, job, c) for c in sorted(final.outputs, key=lambda c: c.index)]
    num_output = sum(len(c.token_ids) for c in final.outputs)
    usage_body = usage(state, len(job.prompt_ids), num_output, final.num_cached_tokens)
    log_chat(state, job, usage_body, ",".join(c["finish_reason"] for c in choices))
    return {
        "id": job.public_id,
        "object": "chat.completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": usage_body,
        "system_fingerprint": None,
        "prompt_logprobs": prompt_logprobs_body(final.prompt_logprobs),
        "kv_transfer_params": final.kv_transfer_params,
    }
