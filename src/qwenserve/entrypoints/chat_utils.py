"""Chat templates: the model's (tokenizer config or GGUF metadata) or one given by the user."""

from __future__ import annotations

import os
from typing import Any


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (no template, a template error, bad messages)."""


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template`` is a file path or the Jinja text itself (as in vLLM)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if any(c in value for c in "{}\n") or not value.endswith((".jinja", ".j2", ".txt")):
        return value
    raise ValueError(f"--chat-template {value}: no such file")


def apply_chat_template(tokenizer: Any, messages: list[dict], chat_template: str | None = None,
                        add_generation_prompt: bool = True, tools: list[dict] | None = None,
                        continue_final_message: bool = False, **kwargs: Any) -> list[int]:
    """Render and tokenize a conversation; template problems raise ``ChatTemplateError``."""
    text = render_chat(tokenizer, messages, chat_template, add_generation_prompt, tools,
                       continue_final_message, **kwargs)
    # The template already placed BOS and other special tokens.
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat(tokenizer: Any, messages: list[dict], chat_template: str | None = None,
                add_generation_prompt: bool = True, tools: list[dict] | None = None,
                continue_final_message: bool = False, **kwargs: Any) -> str:
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError("The model has no chat template; pass --chat-template (a Jinja "
                                "file) or use the completions API")
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tools=tools, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **kwargs)
    except Exception as e:
        raise ChatTemplateError(f"The chat template failed to render these messages "
                                f"({type(e).__name__}: {e})") from e
