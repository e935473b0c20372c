"""``POST /pooling``: vLLM's generic pooling route, with its body and response shape.

The body is vLLM's ``PoolingRequest``: ``input`` (a text, texts, token ids or lists of them) or
``messages`` (rendered with the chat template, ``add_generation_prompt`` false by default), with
``encoding_format`` (float or base64), ``embed_dtype``/``endianness``, ``use_activation``,
``task``, ``truncate_prompt_tokens`` and ``add_special_tokens``. Each prompt comes back as one
``{"index", "object": "pooling", "data"}`` item:

- a reward model (``Qwen2ForRewardModel``, task ``token_classify``): one row per prompt token,
  ``[[r0], [r1], ...]``, the score head's raw output (vLLM 0.32's default; ``sigmoid`` of it
  with ``use_activation: true``); ``--convert reward`` on a causal LM (task ``token_embed``):
  each token's final hidden state, as vLLM's ``as_reward_model`` returned it (normalized with
  ``use_activation: true``);
- an embedding model (task ``embed``): the embedding, normalized unless ``use_activation`` is
  false; a reranker (task ``classify``): ``[score]``.

vLLM serves this route at ``/pooling`` only (no ``/v1/pooling``); so does qwenserve.
"""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request

from qwenserve.config import PoolerConfig
from qwenserve.entrypoints.openai.errors import bad_request
from qwenserve.entrypoints.openai.protocol import ChatMessage, OpenAIBaseModel
from qwenserve.entrypoints.openai.serving_chat import render_prompt
from qwenserve.entrypoints.openai.serving_common import ServerState
from qwenserve.entrypoints.openai.serving_pooling import (
    encode_base64,
    pooling_usage,
    require_pooler,
    run_pooled,
    truncate_ids,
)
from qwenserve.outputs import PooledData
from qwenserve.pooling import embedding, relevance, server_task, token_rows

router = APIRouter()

# vLLM's tasks that were removed, with its messages (a body naming one is refused, as in vLLM)
_REMOVED_TASKS = {"score": "`score` task was removed; use `classify` instead.",
                  "encode": "`encode` task was removed; use `token_embed` or `token_classify` "
                            "instead."}


class PoolingRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    task: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: Literal["float32", "float16"] = "float32"
    endianness: Literal["native", "little", "big"] = "native"
    use_activation: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None  # vLLM: true for input, false for messages
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0
    user: str | None = None
    request_id: str | None = None


def _check(body: PoolingRequest, pooler: PoolerConfig) -> None:
    if body.task in _REMOVED_TASKS:
        raise bad_request(_REMOVED_TASKS[body.task], "task")
    task = server_task(pooler)
    if body.task is not None and body.task != task:
        raise bad_request(f"Unsupported task: {body.task!r} Supported tasks: [{task!r}]", "task")
    if body.dimensions is not None:
        raise bad_request("dimensions is currently not supported", "dimensions")
    if body.priority != 0:
        raise bad_request("priority scheduling is not enabled: priority must be 0", "priority")
    if (body.input is None) == (body.messages is None):
        raise bad_request("give either input or messages", "input")


def _prompts(state: ServerState, body: PoolingRequest) -> list[list[int]]:
    """The body's prompts as token ids, truncated (on the CPU pool)."""
    keep = body.truncate_prompt_tokens
    if body.messages is not None:
        text = render_prompt(state, body.messages, chat_template=body.chat_template,
                             add_generation_prompt=body.add_generation_prompt,
                             continue_final_message=body.continue_final_message, tools=None,
                             template_kwargs=dict(body.chat_template_kwargs or {}))
        state.check_prompt_chars(text, "messages")
        special = bool(body.add_special_tokens)
        return [truncate_ids(state.tokenizer.encode(text, add_special_tokens=special), keep,
                             state)]
    raw = body.input
    items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not items:
        raise bad_request("input must not be empty", "input")
    special = body.add_special_tokens is not False
    prompts = []
    for item in items:
        if isinstance(item, str):
            state.check_prompt_chars(item, "input")
            item = state.tokenizer.encode(item, add_special_tokens=special)
        prompts.append(truncate_ids(list(item), keep, state))
    return prompts


def _data(pooled: PooledData, pooler: PoolerConfig, use_activation: bool | None
          ) -> list[float] | list[list[float]]:
    if pooler.kind == "reward":
        return token_rows(pooled, use_activation, pooler.num_labels)
    if pooler.kind == "embed":
        return embedding(pooled, None, use_activation is not False)
    return [relevance(pooled) if use_activation is not False else pooled[0]]


def _encoded(data: list[float] | list[list[float]], body: PoolingRequest
             ) -> list[float] | list[list[float]] | str:
    if body.encoding_format == "float":
        return data
    flat = [v for row in data for v in row] if data and isinstance(data[0], list) else data
    order = {"little": "<", "big": ">"}.get(body.endianness, "<" if sys.byteorder == "little"
                                            else ">")
    return encode_base64(flat, order, "f" if body.embed_dtype == "float32" else "e")


@router.post("/pooling")
async def create_pooling(body: PoolingRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    require_pooler(state, "reward", "/pooling")
    pooler = state.engine.config.pooler
    name = state.check_model(body.model)
    _check(body, pooler)
    prompts = await state.offload(_prompts, state, body)
    pooled = await run_pooled(state, prompts, "pool")
    data = [{"index": i, "object": "pooling",
             "data": _encoded(_data(p, pooler, body.use_activation), body)}
            for i, p in enumerate(pooled)]
    return {"id": f"pooling-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": name, "data": data, "usage": pooling_usage(prompts)}
