"""The FastAPI application: routes, error envelopes, middleware.

``build_app(state)`` takes a ready ``ServerState`` (engine loaded), so tests can also build the
app around a scripted engine and drive it in-process.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from qwenserve import __version__
from qwenserve.entrypoints.openai import (
    serving_chat,
    serving_chat_stream,
    serving_completion,
    serving_models,
    serving_pooling,
    serving_pooling_any,
)
from qwenserve.entrypoints.openai.errors import OpenAIError, error_body, internal_error
from qwenserve.entrypoints.openai.middleware import (
    AuthMiddleware,
    BodyLimitMiddleware,
    ServerStateMiddleware,
)
from qwenserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIBaseModel,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from qwenserve.entrypoints.openai.request_fields import unknown_fields
from qwenserve.entrypoints.openai.serving_common import ServerState, engine_error, logger
from qwenserve.entrypoints.openai.streaming import (
    DisconnectAwareStreamingResponse,
    cancel_on_disconnect,
)
from qwenserve.entrypoints.openai.structured import check_grammar

router = APIRouter()
# Routes that change server state for benchmarks and debugging: only with
# QWENSERVE_SERVER_DEV_MODE=1 (or vLLM's VLLM_SERVER_DEV_MODE=1), as vLLM does.
dev_router = APIRouter()
# vLLM's defaults (--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials)
_DEFAULT_CORS = {
    "allow_origins": ["*"],
    "allow_methods": ["*"],
    "allow_headers": ["*"],
    "allow_credentials": False,
}


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _warn_ignored(body: OpenAIBaseModel) -> None:
    endpoint = "chat" if isinstance(body, ChatCompletionRequest) else "completion"
    ignored = unknown_fields(body, endpoint)  # vLLM's fields are honoured or refused
    if ignored:
        logger.warning(
            "The following fields were present in the request but ignored: %s", set(ignored)
        )


@router.get("/health")
async def health(request: Request) -> Response:
    """200 with an empty body while the engine runs; 503 once it has died."""
    return Response(status_code=200 if _state(request).engine.is_running else 503)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    return await health(request)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    from qwenserve.metrics.prometheus import exposition

    return Response(exposition(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return serving_models.list_models(_state(request))


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.check_model(model)
    return serving_models.model_card(state, model)


@router.post("/tokenize")
async def tokenize(
    body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request
) -> dict[str, Any]:
    state = _state(request)
    return await state.offload(serving_models.tokenize, state, body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    return await state.offload(serving_models.detokenize, state, body)


@dev_router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> Response:
    """Drop cached prefixes (benchmarks use it between runs); blocks in use stay."""
    try:
        complete = await _state(request).engine.reset_prefix_cache()
    except Exception as e:  # e.g. the engine died: a 503 that says so
        raise engine_error(e) from e
    if not complete:
        logger.warning("The prefix cache was not fully reset: some blocks are still in use")
    return Response(status_code=200)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    state = _state(request)
    _warn_ignored(body)
    job = await state.offload(
        serving_completion.prepare_completion, state, body, request.headers.get("x-request-id")
    )
    await check_grammar(state, [p.params for p in job.prompts], job.constraint_source)
    if not body.stream:
        result = await cancel_on_disconnect(
            request, serving_completion.complete(state, job), state.stopping
        )
        return JSONResponse(result) if result is not None else Response(status_code=499)
    merged = serving_completion.start_stream(state, job)
    first = await _first_output(request, merged, state.stopping)
    if first is None:
        return Response(status_code=499)
    return DisconnectAwareStreamingResponse(
        serving_completion.stream_completion(state, job, first, merged), state.stopping
    )


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    state = _state(request)
    _warn_ignored(body)
    job = await state.offload(
        serving_chat.prepare_chat, state, body, request.headers.get("x-request-id")
    )
    await check_grammar(state, [job.params], job.constraint_source)
    state.admission.check(body.n)
    images = {"mm_inputs": job.mm_inputs} if job.mm_inputs is not None else {}
    agen = state.admission.admit(
        state.engine.generate(job.prompt_ids, job.params, job.engine_id, prompt=job.prompt_text,
                              **images),
        body.n,
    )
    if not body.stream:
        result = await cancel_on_disconnect(
            request, serving_chat.chat_complete(state, job, agen), state.stopping
        )
        return JSONResponse(result) if result is not None else Response(status_code=499)
    first = await _first_output(request, agen, state.stopping)
    if first is None:
        return Response(status_code=499)
    return DisconnectAwareStreamingResponse(
        serving_chat_stream.stream_chat(state, job, first, agen), state.stopping
    )


async def _first_output(request: Request, agen: Any, stop: asyncio.Event) -> Any:
    """Wait for the first output before answering 200, so that a request the engine refuses
    gets a plain 400 rather than an error inside an event stream. None: the client left."""
    try:
        first = await cancel_on_disconnect(request, agen.__anext__(), stop)
    except StopAsyncIteration:
        first = None
    except Exception as e:
        await agen.aclose()
        raise engine_error(e) from e
    if first is None:
        await agen.aclose()
    return first


# ---- errors ------------------------------------------------------------------------------------
def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        reason = (detail.get("ctx") or {}).get("error", detail.get("msg"))
        return f"Invalid JSON in the request body: {reason}", None
    # A body that is a union (``/tokenize``) puts the model's class name into the location.
    locs = [
        [str(p) for p in e.get("loc", ()) if p != "body" and not str(p).endswith("Request")]
        for e in errors
    ]
    prefix: list[str] = []
    for parts in zip(*locs, strict=False):
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    param = ".".join(prefix or locs[0]) if locs and (prefix or locs[0]) else None
    shown = [
        f"{'.'.join(loc) or 'body'}: {e.get('msg')}" for loc, e in zip(locs, errors, strict=True)
    ][:4]
    return "; ".join(shown), param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), exc.status_code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        error = internal_error(logger, f"Unexpected error serving {request.url.path}", exc)
        return JSONResponse(error.body(), status_code=500)


def build_app(
    state: ServerState,
    registry: Any,
    api_keys: list[str] | None = None,
    max_body_bytes: int = 32 << 20,
    cors: dict[str, Any] | None = None,
    echo_request_id: bool = False,
    enable_docs: bool = True,
    dev_mode: bool = False,
) -> FastAPI:
    app = FastAPI(
        title="qwenserve",
        version=__version__,
        docs_url="/docs" if enable_docs else None,
        redoc_url="/redoc" if enable_docs else None,
    )
    app.state.server = state
    app.state.registry = registry
    app.include_router(router)
    app.include_router(serving_pooling.router)  # /v1/embeddings, /score, /rerank
    app.include_router(serving_pooling_any.router)  # /pooling
    if dev_mode:
        app.include_router(dev_router)
    _install_error_handlers(app)
    # Starlette runs the last-added middleware first: body limit, then auth, then the rest.
    app.add_middleware(ServerStateMiddleware, state=state, echo_request_id=echo_request_id)
    if api_keys:
        app.add_middleware(AuthMiddleware, api_keys=api_keys)
    from fastapi.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, **(cors or _DEFAULT_CORS))
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    return app
