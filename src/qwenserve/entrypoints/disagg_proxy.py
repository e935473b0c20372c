"""``qwenserve disagg-proxy --prefill URL... --decode URL...``: the prefill/decode proxy.

vLLM's P/D request flow (its ``toy_proxy_server.py`` example), round-robin over each list:

    client --> proxy --1--> prefill instance (kv_producer): the request with max_tokens 1,
                            not streamed, kv_transfer_params {"do_remote_decode": true}
                     <----- its answer's kv_transfer_params: where the prompt's KV waits
                     --2--> decode instance (kv_consumer): the original request plus those
                            kv_transfer_params; it pulls the KV, then decodes
           <--------------- the decode instance's answer (streamed when asked), as is

Any OpenAI-compatible P/D pair speaking vLLM's ``kv_transfer_params`` works behind it.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}
_FORWARDED_HEADERS = ("authorization", "x-request-id")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="Prefill instances (kv_producer), e.g. http://10.0.0.1:8100")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="Decode instances (kv_consumer), e.g. http://10.0.0.2:8200")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="Seconds to wait for an instance's answer (default 600)")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, not streamed, and the producer asked to hold the KV."""
    out = {**body, "kv_transfer_params": dict(PREFILL_PARAMS), "stream": False,
           "max_tokens": 1}
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def build_app(prefill_urls: list[str], decode_urls: list[str],
              timeout_s: float = 600.0) -> FastAPI:
    prefills = itertools.cycle([u.rstrip("/") for u in prefill_urls])
    decodes = itertools.cycle([u.rstrip("/") for u in decode_urls])
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="qwenserve disagg-proxy", lifespan=lifespan)

    def headers_of(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}

    async def relay(path: str, request: Request) -> Response:
        body = await request.json()
        headers = headers_of(request)
        try:
            pre = await client.post(next(prefills) + path, json=prefill_body(body),
                                    headers=headers)
        except httpx.HTTPError as e:
            return _unavailable(f"the prefill instance is unreachable: {e}")
        if pre.status_code != 200:
            return Response(pre.content, pre.status_code, media_type="application/json")
        kv = pre.json().get("kv_transfer_params")
        decode_body = {**body, "kv_transfer_params": kv} if kv else body
        url = next(decodes) + path
        if not body.get("stream"):
            try:
                out = await client.post(url, json=decode_body, headers=headers)
            except httpx.HTTPError as e:
                return _unavailable(f"the decode instance is unreachable: {e}")
            return Response(out.content, out.status_code, media_type="application/json")
        try:
            upstream = await client.send(client.build_request("POST", url, json=decode_body,
                                                              headers=headers), stream=True)
        except httpx.HTTPError as e:
            return _unavailable(f"the decode instance is unreachable: {e}")
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, upstream.status_code, media_type="application/json")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    def _unavailable(message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "ServiceUnavailableError",
                                       "param": None, "code": 503}}, 503)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await relay("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        out = await client.get(next(decodes) + "/v1/models", headers=headers_of(request))
        return Response(out.content, out.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def run(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_app(args.prefill, args.decode, args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
