"""``/v1/models``, ``/tokenize`` and ``/detokenize`` (vLLM's bodies and fields)."""

from __future__ import annotations

from typing import Any

from qwenserve.entrypoints.openai.errors import bad_request
from qwenserve.entrypoints.openai.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from qwenserve.entrypoints.openai.serving_chat import render_prompt
from qwenserve.entrypoints.openai.serving_common import ServerState


def model_card(state: ServerState, name: str) -> dict[str, Any]:
    """vLLM's ``ModelCard``; ``max_model_len`` is the vLLM extra clients use to size prompts."""
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "vllm",
        "root": state.model_root,
        "parent": None,
        "max_model_len": state.max_model_len,
        "permission": [
            {
                "id": f"modelperm-{name}",
                "object": "model_permission",
                "created": state.created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def list_models(state: ServerState) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [model_card(state, n) for n in state.options.served_model_names],
    }


def tokenize(
    state: ServerState, req: TokenizeCompletionRequest | TokenizeChatRequest
) -> dict[str, Any]:
    state.check_model(req.model)
    if isinstance(req, TokenizeChatRequest):
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        kwargs = {**state.options.default_chat_template_kwargs, **(req.chat_template_kwargs or {})}
        text = render_prompt(
            state,
            req.messages,
            chat_template=req.chat_template,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=tools,
            template_kwargs=_safe_kwargs(kwargs),
        )
    else:
        text = req.prompt
    state.check_prompt_chars(text, "messages" if isinstance(req, TokenizeChatRequest) else "prompt")
    ids = state.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    strs = state.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": state.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def _safe_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    from qwenserve.entrypoints.openai.serving_chat import _RESERVED_TEMPLATE_KWARGS

    return {k: v for k, v in kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}


def detokenize(state: ServerState, req: DetokenizeRequest) -> dict[str, Any]:
    state.check_model(req.model)
    bad = next((t for t in req.tokens if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"Token id {bad} is out of vocabulary (size {state.vocab_size})", "tokens"
        )
    return {"prompt": state.tokenizer.decode(req.tokens)}
