"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extra fields.

Unknown fields are accepted and ignored, as vLLM does (``extra="allow"``); the server logs them.
Non-finite floats (``NaN``, ``Infinity``, which Python's JSON parser accepts) are refused here so
they never reach the sampler. Range checks live in ``SamplingParams`` (one place, messages that
name the field); the bounds below only keep values inside what the engine can represent.
Responses are plain dicts built by the serving modules (cheaper per streamed chunk).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

INT64_MAX = 2**63 - 1
MAX_N = 128  # n copies run as n sequences; a cap keeps one request from swamping the engine


_SURROGATE = re.compile("[\ud800-\udfff]")


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where in a parsed JSON body a lone surrogate (``"\\ud800"``) sits, or None. JSON allows
    them, Unicode does not: the tokenizer and the UTF-8 response encoder both fail on them."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return where or "body"
        elif isinstance(item, dict):
            for key, sub in item.items():
                if isinstance(key, str) and _SURROGATE.search(key):
                    return where or "body"
                stack.append((f"{where}.{key}" if where else str(key), sub))
        elif isinstance(item, list):
            stack.extend((f"{where}.{i}" if where else str(i), sub) for i, sub in enumerate(item))
    return None


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class RequestBody(OpenAIBaseModel):
    """A whole request body: checked once for text that is not valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        where = find_lone_surrogate(data)
        if where is not None:
            raise ValueError(
                f"{where} contains a lone UTF-16 surrogate (such as \\ud800), which is not "
                "valid Unicode; send UTF-8 text"
            )
        return data


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict", "description"}


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` body field; unknown keys are a 400, never ignored."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class SamplingRequest(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    prompt_logprobs: int | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    thinking_token_budget: int | None = Field(None, ge=0, le=INT64_MAX)
    request_id: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # P/D disaggregation (the proxy sets it)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=-INT64_MAX, le=INT64_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=-INT64_MAX, le=INT64_MAX)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=-INT64_MAX, le=INT64_MAX)
    add_special_tokens: bool = True


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(OpenAIBaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=-INT64_MAX, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=-INT64_MAX, le=INT64_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(0, ge=-INT64_MAX, le=INT64_MAX)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    include_reasoning: bool = True
    reasoning_effort: Literal["low", "medium", "high"] | None = None


class TokenizeCompletionRequest(RequestBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(RequestBody):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]
