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
    chat_template_tokens: int = 0  # added to a chat prompt's count, as a chat template would


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


class FakeOpenAI:
    """The endpoints; ``cfg`` shapes the answers, ``state`` records what was asked."""

    def __init__(self, cfg: FakeConfig, state: FakeState) -> None:
        self.cfg, self.state = cfg, state

    def authorized(self, request: Request) -> bool:
        key = self.cfg.api_key
        return key is None or request.headers.get("authorization") == f"Bearer {key}"

    async def models(self, request: Request) -> Response:
        if not self.authorized(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        data = [{"id": m, "object": "model", "root": f"/models/{m}"} for m in self.cfg.models]
        return JSONResponse({"object": "list", "data": data})

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def generate(self, request: Request, chat: bool) -> Response:
        if not self.authorized(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        body = await request.json()
        self.state.requests.append(body)
        self.state.headers.append(dict(request.headers))
        if body.get("model") not in self.cfg.models:
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        prompt = body["messages"][0]["content"][0]["text"] if chat else body["prompt"]
        if "FAIL" in prompt:
            return _error(500, "injected failure")
        max_tokens = body.get("max_completion_tokens" if chat else "max_tokens") or 16
        events = self.stream(prompt, max_tokens, chat, body)
        return StreamingResponse(events, media_type="text/event-stream")

    async def stream(self, prompt: str, n: int, chat: bool, body: dict) -> AsyncIterator[str]:
        await asyncio.sleep(self.cfg.ttft_s)
        if "STREAMERR" in prompt:
            yield "data: " + json.dumps({"error": {"message": "engine died", "code": 500}}) + "\n\n"
            yield "data: [DONE]\n\n"
            return
        if chat:
            yield _chunk({"delta": {"role": "assistant", "content": ""}}, chat)
        for i in range(n):
            if i:
                await asyncio.sleep(self.cfg.itl_s)
            text = f"w{i % VOCAB} "
            yield _chunk({"delta": {"content": text}} if chat else {"text": text}, chat)
        num_prompt = len(encode(prompt)) + (self.cfg.chat_template_tokens if chat else 0)
        self.state.success += 1
        self.state.prompt_tokens += num_prompt
        self.state.generation_tokens += n
        usage = {"prompt_tokens": num_prompt, "completion_tokens": n}
        if self.cfg.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"

    async def tokenize(self, request: Request) -> Response:
        if not self.cfg.tokenize:
            return _error(404, "Not Found")
        tokens = encode((await request.json())["prompt"])
        return JSONResponse({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        if not self.cfg.tokenize:
            return _error(404, "Not Found")
        return JSONResponse({"prompt": decode((await request.json())["tokens"])})

    async def reset(self) -> Response:
        if not self.cfg.reset_cache:
            return _error(404, "Not Found")
        self.state.resets += 1
        return Response(status_code=200)

    async def metrics(self) -> Response:
        labels = f'model_name="{self.cfg.models[0]}",engine="0"'
        lines = [
            f'vllm:request_success_total{{{labels},finished_reason="length"}} '
            f"{float(self.state.success)}",
            f"vllm:prompt_tokens_total{{{labels}}} {float(self.state.prompt_tokens)}",
            f"vllm:generation_tokens_total{{{labels}}} {float(self.state.generation_tokens)}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")


def build_app(cfg: FakeConfig, state: FakeState) -> FastAPI:
    api = FakeOpenAI(cfg, state)
    app = FastAPI()
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/reset_prefix_cache", api.reset, methods=["POST"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
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
