"""Chat templates: the model's (tokenizer config or GGUF metadata) or one given by the user."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (no template, a template error, bad messages)."""


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template`` is a file path or the Jinja text itself (as in vLLM)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    # vLLM's rule: text with no Jinja characters is a path, and a missing one is an error
    # (rather than a template that prints the path).
    raise ValueError(
        f"--chat-template {value}: no such file (and not a template: it has no '{{', '}}' "
        "or newline); give an existing file or the template text"
    )


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> list[int]:
    """Render and tokenize a conversation; template problems raise ``ChatTemplateError``."""
    text = render_chat(
        tokenizer,
        messages,
        chat_template,
        add_generation_prompt,
        tools,
        continue_final_message,
        **kwargs,
    )
    # The template already placed BOS and other special tokens.
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> str:
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError(
            "The model has no chat template; pass --chat-template (a Jinja "
            "file) or use the completions API"
        )
    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except Exception as e:
        raise ChatTemplateError(
            f"The chat template failed to render these messages ({type(e).__name__}: {e})"
        ) from e


class ChatMessageError(ValueError):
    """A message the server cannot pass to a template (unsupported content, bad tool call)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def normalize_messages(messages: list[dict], content_format: str = "string") -> list[dict]:
    """OpenAI messages -> what Hugging Face chat templates expect.

    - ``content`` given as parts (``[{"type": "text", "text": ...}]``) is joined into one string
      (``content_format="string"``, what Qwen templates iterate over) or kept as parts
      (``"openai"``); non-text parts are refused: the models served are text-only.
    - ``developer`` (OpenAI's newer name for the system role) becomes ``system``.
    - tool-call ``arguments`` sent back as JSON strings become objects, because Qwen templates
      render them with ``tojson``.
    """
    if not messages:
        raise ChatMessageError("messages must contain at least one message")
    return [_normalize(i, dict(m), content_format) for i, m in enumerate(messages)]


def _normalize(index: int, message: dict, content_format: str) -> dict:
    if message.get("role") == "developer":
        message["role"] = "system"
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = _join_parts(index, content, content_format)
    elif content is None and message.get("role") != "assistant":
        message["content"] = ""
    if message.get("tool_calls"):
        message["tool_calls"] = [_tool_call_for_template(index, c) for c in message["tool_calls"]]
    for key in [k for k, v in message.items() if v is None]:
        del message[key]
    return message


def _join_parts(index: int, parts: list, content_format: str) -> str | list:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text") and not isinstance(part.get("text"), str):
            raise ChatMessageError(
                f"messages[{index}].content[{j}]: a {kind!r} part needs a string 'text' field",
                param=f"messages.{index}.content",
            )
        if kind not in ("text", "input_text"):
            raise ChatMessageError(
                f"messages[{index}].content[{j}]: content part type {kind!r} is not supported; "
                'qwenserve serves text-only models (use {"type": "text", "text": ...})',
                param=f"messages.{index}.content",
            )
        texts.append(part["text"])
    if content_format == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def _tool_call_for_template(index: int, call: dict) -> dict:
    call = dict(call)
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ChatMessageError(
                f"messages[{index}].tool_calls: arguments of {function.get('name')!r} are not "
                f"valid JSON ({e})",
                param=f"messages.{index}.tool_calls",
            ) from e
    call["function"] = function
    return call
