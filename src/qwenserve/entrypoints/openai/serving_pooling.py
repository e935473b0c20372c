"""Pooling models' routes (``--runner pooling``), with vLLM's bodies and response shapes:

- ``POST /v1/embeddings`` (OpenAI's shape; ``dimensions`` cuts before normalizing, Matryoshka;
  ``encoding_format`` float or base64 little-endian float32, the OpenAI client's default);
- ``POST /score``, ``/v1/score`` (``text_1`` against ``text_2``: one to many, or pairwise);
- ``POST /rerank``, ``/v1/rerank`` (``query`` and ``documents``, best first, ``top_n``).

A reranker scores ``query + document`` tokens (the tokenizer's text pair) as vLLM does; an
embedding model's score is the cosine similarity of the two embeddings, also as vLLM does.
Every prompt is one sequence under the server's admission caps (``--max-sequences-per-request``:
400, ``--max-queued-sequences``: 429), and tokenizing runs on the CPU pool, as for generation.
"""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from qwenserve.entrypoints.openai.errors import bad_request, from_value_error
from qwenserve.entrypoints.openai.protocol import OpenAIBaseModel
from qwenserve.entrypoints.openai.serving_common import ServerState, engine_error
from qwenserve.entrypoints.openai.streaming import merge_async_iterators
from qwenserve.outputs import PooledData
from qwenserve.pooling import embedding, pooling_params, relevance

router = APIRouter()


class EmbeddingRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool = True


class ScoreRequest(OpenAIBaseModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None


class RerankRequest(OpenAIBaseModel):
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def run_pooled(state: ServerState, prompts: list[list[int]], prefix: str
                     ) -> list[PooledData]:
    """Run the prompts through the pooling engine concurrently; their pooled outputs in order
    (one vector each, or one row per token for a reward model)."""
    for ids in prompts:
        state.check_prompt_ids(ids)
    _, engine_id = state.request_ids(prefix, None)
    params = pooling_params()
    state.admission.check(len(prompts))  # (no await between the check and the reservations)
    gens = [state.admission.admit(state.engine.generate(ids, params, f"{engine_id}-{i}"), 1)
            for i, ids in enumerate(prompts)]
    results: list[PooledData | None] = [None] * len(prompts)
    try:
        async for i, out in merge_async_iterators(*gens):
            if out.finished:
                results[i] = out.pooled
    except ValueError as e:
        raise from_value_error(e) from e
    except Exception as e:  # the engine died or refused
        raise engine_error(e) from e
    return [r for r in results if r is not None]


def truncate_ids(ids: list[int], keep: int | None, state: ServerState) -> list[int]:
    if keep is None:
        return ids
    keep = state.max_model_len if keep == -1 else keep
    if keep < 1:
        raise bad_request("truncate_prompt_tokens must be -1 or >= 1", "truncate_prompt_tokens")
    return ids[-keep:]


def tokenized_prompts(state: ServerState, items: list[str | list[int]], keep: int | None
               ) -> list[list[int]]:
    """Texts (length-checked before tokenizing) or token ids -> truncated prompts (CPU pool)."""
    for x in items:
        if isinstance(x, str):
            state.check_prompt_chars(x, "input")
    return [truncate_ids(state.tokenizer.encode(x) if isinstance(x, str) else list(x), keep, state)
            for x in items]


def _pair_prompts(state: ServerState, pairs: list[tuple[str, str]], keep: int | None
                  ) -> list[list[int]]:
    """A reranker's (query, document) text pairs -> truncated prompts (CPU pool)."""
    for pair in pairs:
        for text in pair:
            state.check_prompt_chars(text, "documents")
    return [truncate_ids(state.tokenizer(text=q, text_pair=d)["input_ids"], keep, state)
            for q, d in pairs]


def pooling_usage(prompts: list[list[int]]) -> dict[str, int]:
    tokens = sum(map(len, prompts))
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def require_pooler(state: ServerState, kind: str, route: str) -> None:
    pooler = state.engine.config.pooler
    if pooler is None:
        raise bad_request(f"{route} needs a pooling model: serve an embedding, reranker or "
                          "reward model with --runner pooling")
    if pooler.kind == "reward" and kind != "reward":
        raise bad_request(f"{route}: this is a reward model, which scores every token; use "
                          "/pooling")
    if kind == "embed" and pooler.kind != "embed":
        raise bad_request(f"{route}: this is a scoring (reranker) model; use /score or /rerank")


@router.post("/v1/embeddings")
async def create_embedding(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    require_pooler(state, "embed", "/v1/embeddings")
    name = state.check_model(body.model)
    if body.encoding_format not in ("float", "base64"):
        raise bad_request("encoding_format must be 'float' or 'base64'", "encoding_format")
    raw = body.input
    items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not items:
        raise bad_request("input must not be empty", "input")
    state.admission.check(len(items))  # before paying for tokenizing
    prompts = await state.offload(tokenized_prompts, state, items, body.truncate_prompt_tokens)
    pooled = await run_pooled(state, prompts, "embd")
    try:
        vectors = [embedding(p, body.dimensions, body.normalize) for p in pooled]
    except ValueError as e:
        raise bad_request(str(e), "dimensions") from e
    data = [{"index": i, "object": "embedding", "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": name, "data": data, "usage": pooling_usage(prompts)}


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return encode_base64(vector)


def encode_base64(values: list[float], byte_order: str = "<", fmt: str = "f") -> str:
    """float32 (``fmt`` "f"; "e": float16) values, a vector or a matrix's rows flattened, as
    base64: OpenAI's encoding."""
    return base64.b64encode(struct.pack(f"{byte_order}{len(values)}{fmt}", *values)).decode()


async def _scores(state: ServerState, pairs: list[tuple[str, str]], truncate: int | None,
                  prefix: str) -> tuple[list[float], list[list[int]]]:
    """One relevance score per (query, document) pair, and the prompts that were run."""
    pooler = state.engine.config.pooler
    if pooler.kind == "classify":
        state.admission.check(len(pairs))  # before paying for tokenizing
        prompts = await state.offload(_pair_prompts, state, pairs, truncate)
        return [relevance(p) for p in await run_pooled(state, prompts, prefix)], prompts
    texts = list(dict.fromkeys([t for pair in pairs for t in pair]))
    state.admission.check(len(texts))
    prompts = await state.offload(tokenized_prompts, state, texts, truncate)
    vectors = dict(zip(texts, (embedding(p) for p in await run_pooled(state, prompts, prefix)),
                       strict=True))
    return [math.fsum(a * b for a, b in zip(vectors[q], vectors[d], strict=True))
            for q, d in pairs], prompts


def _pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    first = [text_1] if isinstance(text_1, str) else text_1
    second = [text_2] if isinstance(text_2, str) else text_2
    if not first or not second:
        raise bad_request("text_1 and text_2 must not be empty")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise bad_request(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one "
                          "text_1, or as many as text_2 (scored pairwise)", "text_2")
    return list(zip(first, second, strict=True))


@router.post("/score")
@router.post("/v1/score")
async def create_score(body: ScoreRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    require_pooler(state, "score", "/score")
    name = state.check_model(body.model)
    scores, prompts = await _scores(state, _pairs(body.text_1, body.text_2),
                                    body.truncate_prompt_tokens, "score")
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": name, "usage": pooling_usage(prompts),
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]}


@router.post("/rerank")
@router.post("/v1/rerank")
async def create_rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    require_pooler(state, "score", "/rerank")
    name = state.check_model(body.model)
    if body.top_n is not None and body.top_n < 1:
        raise bad_request("top_n must be >= 1", "top_n")
    scores, prompts = await _scores(state, [(body.query, d) for d in body.documents],
                                    body.truncate_prompt_tokens, "rerank")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    results = [{"index": i, "relevance_score": scores[i],
                "document": {"text": body.documents[i]} if body.return_documents else None}
               for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": name,
            "usage": {"total_tokens": sum(map(len, prompts))}, "results": results}
