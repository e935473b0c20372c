"""A deterministic OpenAI-compatible SSE server for the benchmark's tests (tests only).

It streams one chunk per output token: the first after ``ttft_s``, the rest ``itl_s`` apart, so
the client's TTFT, ITL, TPOT and E2EL can be checked against known values. Tokens are words
``w<id>``: ``/tokenize`` and ``/detokenize`` round-trip exactly, which the random dataset needs.
Prompts containing ``FAIL`` get HTTP 500; ``STREAMERR`` gets an error event mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

VOCAB = 1000


@dataclass
class FakeConfig:
    ttft_s: float = 0.05
    itl_s: float = 0.02
    models: tuple[str, ...] = ("fake-model",)
    api_key: str | None = None
    send_usage: bool = True
    tokenize: bool = True
    reset_cache: bool = True


@dataclass
class FakeState:
    """What the server saw, for assertions; counters mirror vLLM's metric names."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    success: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    resets: int = 0


def encode(text: str) -> list[int]:
    return [
        int(w[1:]) if re.fullmatch(r"w\d+", w) else zlib.crc32(w.encode()) % VOCAB
        for w in text.split()
    ]


def decode(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def _error(status: int, message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def build_app(cfg: FakeConfig, state: FakeState) -> FastAPI:
    app = FastAPI()

    def authorized(request: Request) -> bool:
        return cfg.api_key is None or request.headers.get("authorization") == f"Bearer {cfg.api_key}"

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not authorized(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        data = [{"id": m, "object": "model", "root": f"/models/{m}"} for m in cfg.models]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool) -> Response:
        if not authorized(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        body = await request.json()
        state.requests.append(body)
        state.headers.append(dict(request.headers))
        if body.get("model") not in cfg.models:
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        prompt = body["messages"][0]["content"][0]["text"] if chat else body["prompt"]
        if "FAIL" in prompt:
            return _error(500, "injected failure")
        max_tokens = body.get("max_completion_tokens" if chat else "max_tokens") or 16
        events = _stream(prompt, max_tokens, chat, body)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _stream(prompt: str, n: int, chat: bool, body: dict) -> AsyncIterator[str]:
        await asyncio.sleep(cfg.ttft_s)
        if "STREAMERR" in prompt:
            yield "data: " + json.dumps({"error": {"message": "engine died", "code": 500}}) + "\n\n"
            yield "data: [DONE]\n\n"
            return
        if chat:
            yield _chunk({"delta": {"role": "assistant", "content": ""}}, chat)
        for i in range(n):
            if i:
                await asyncio.sleep(cfg.itl_s)
            text = f"w{i % VOCAB} "
            yield _chunk({"delta": {"content": text}} if chat else {"text": text}, chat)
        state.success += 1
        state.prompt_tokens += len(encode(prompt))
        state.generation_tokens += n
        usage = {"prompt_tokens": len(encode(prompt)), "completion_tokens": n}
        if cfg.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        if not cfg.tokenize:
            return _error(404, "Not Found")
        tokens = encode((await request.json())["prompt"])
        return JSONResponse({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        if not cfg.tokenize:
            return _error(404, "Not Found")
        return JSONResponse({"prompt": decode((await request.json())["tokens"])})

    @app.post("/reset_prefix_cache")
    async def reset() -> Response:
        if not cfg.reset_cache:
            return _error(404, "Not Found")
        state.resets += 1
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        label = f'{{model_name="{cfg.models[0]}",engine="0"}}'
        lines = [
            f'vllm:request_success_total{{model_name="{cfg.models[0]}",engine="0",'
            f'finished_reason="length"}} {float(state.success)}',
            f"vllm:prompt_tokens_total{label} {float(state.prompt_tokens)}",
            f"vllm:generation_tokens_total{label} {float(state.generation_tokens)}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    return app


def _chunk(choice: dict[str, Any], chat: bool) -> str:
    obj = "chat.completion.chunk" if chat else "text_completion"
    return "data: " + json.dumps({"object": obj, "choices": [{"index": 0, **choice}]}) + "\n\n"


class FakeServer:
    """Runs ``build_app`` with uvicorn in a daemon thread on an ephemeral 127.0.0.1 port."""

    def __init__(self, cfg: FakeConfig | None = None) -> None:
        self.cfg = cfg or FakeConfig()
        self.state = FakeState()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(self.cfg, self.state), log_level="warning",
                                lifespan="off")  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, args=([self._sock],), daemon=True)

    def start(self) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()
