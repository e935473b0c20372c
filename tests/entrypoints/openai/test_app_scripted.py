"""The app in-process around a scripted engine that emits a fixed Qwen-style answer (thinking,
then a tool call), driven by the ``openai`` client: reasoning and tool-call fields, streamed and
not, exactly as a real Qwen3 model would produce them."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from qwenserve.entrypoints.openai.api_server import build_server_app
from qwenserve.entrypoints.openai.cli_args import make_serve_parser
from qwenserve.entrypoints.openai.serving_common import ServerState, ServingOptions
from qwenserve.metrics.prometheus import make_registry
from qwenserve.outputs import CompletionOutput, RequestOutput
from qwenserve.sampling_params import RequestOutputKind

SCRIPT = [
    "<think>",
    "\nLet me ",
    "check.</th",
    "ink>\n\nSure, ",
    "checking.",
    "<tool_",
    'call>\n{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}\n</tool_call>',
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
MSG = [{"role": "user", "content": "Weather in Paris?"}]


class ScriptedEngine:
    """``AsyncEngine``'s interface; every request produces SCRIPT, one piece per step."""

    is_running = True

    def __init__(self, tokenizer, generation_defaults=None) -> None:
        self.tokenizer = tokenizer
        self.params = []
        model = SimpleNamespace(
            name="scripted",
            vocab_size=len(tokenizer),
            generation_defaults=generation_defaults or {},
        )
        self.config = SimpleNamespace(
            model=model, max_logprobs=20, scheduler=SimpleNamespace(max_model_len=256)
        )

    def get_tokenizer(self):
        return self.tokenizer

    def num_unfinished_requests(self) -> int:
        return 0

    async def reset_prefix_cache(self) -> bool:
        return True

    async def generate(self, prompt_ids, params, request_id, prompt=None):
        self.params.append(params)

        def output(texts, finished):
            outs = [
                CompletionOutput(
                    i, "".join(texts), [7] * len(texts), finish_reason="stop" if finished else None
                )
                for i in range(params.n)
            ]
            return RequestOutput(request_id, prompt, prompt_ids, outs, finished)

        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            yield output(SCRIPT, True)
            return
        for i, piece in enumerate(SCRIPT):
            await asyncio.sleep(0)
            yield output([piece], i == len(SCRIPT) - 1)


@pytest.fixture
def client(monkeypatch):
    from helpers.tiny_models import build_tokenizer

    monkeypatch.setenv("QWENSERVE_API_KEY", "env-key")
    args = make_serve_parser().parse_args(["--served-model-name", "qwen3"])
    options = ServingOptions(
        ["qwen3"], reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True
    )
    app = build_server_app(
        args,
        ServerState(ScriptedEngine(build_tokenizer()), options),
        make_registry(process_metrics=False),
    )
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(
        base_url="http://test/v1", api_key="env-key", http_client=http, max_retries=0
    )


def test_whole_answer_has_reasoning_content_and_tool_calls(client):
    out = asyncio.run(client.chat.completions.create(model="qwen3", messages=MSG, tools=TOOLS))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.model_extra["reasoning_content"] == "\nLet me check."
    assert message.model_extra["reasoning"] == "\nLet me check."
    assert message.content == "\n\nSure, checking."
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("chatcmpl-tool-")


def test_streamed_answer_gives_the_same_fields(client):
    async def main():
        stream = await client.chat.completions.create(
            model="qwen3", messages=MSG, tools=TOOLS, stream=True
        )
        return [chunk async for chunk in stream]

    chunks = asyncio.run(main())
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = content = ""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        reasoning += extra.get("reasoning_content") or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = entry["id"] or tc.id
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert reasoning == "\nLet me check." and content == "\n\nSure, checking."
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "<tool_call>" not in content and "<think>" not in reasoning


def test_without_tools_the_call_stays_content_and_reasoning_can_be_dropped(client):
    out = asyncio.run(
        client.chat.completions.create(
            model="qwen3", messages=MSG, extra_body={"include_reasoning": False}
        )
    )
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop" and not message.tool_calls
    assert message.content.startswith("\n\nSure, checking.<tool_call>")
    assert message.model_extra["reasoning_content"] is None


def test_api_key_from_the_environment(client):
    bad = openai.AsyncOpenAI(
        base_url="http://test/v1", api_key="other", http_client=client._client, max_retries=0
    )

    async def first_model(c):
        return (await c.models.list()).data[0].id

    with pytest.raises(openai.AuthenticationError):
        asyncio.run(first_model(bad))
    assert asyncio.run(first_model(client)) == "qwen3"


def _defaults_app(generation_defaults: dict, **options):
    from helpers.tiny_models import build_tokenizer

    engine = ScriptedEngine(build_tokenizer(), generation_defaults)
    args = make_serve_parser().parse_args([])
    state = ServerState(engine, ServingOptions(["m"], **options))
    app = build_server_app(args, state, make_registry(process_metrics=False))

    def call(**kwargs):
        async def post():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                body = {"messages": MSG, **kwargs}
                return (await c.post("/v1/chat/completions", json=body)).status_code

        assert asyncio.run(post()) == 200
        return engine.params[-1]

    return call


def test_generation_config_defaults_fill_unset_fields():
    """--generation-config auto: the model's values for fields the request leaves unset
    (max_new_tokens only when max_tokens is unset, as vLLM); --override-generation-config on
    top, and its max_new_tokens caps every request."""
    call = _defaults_app(
        {"temperature": 0.6, "top_k": 20, "max_tokens": 9}, generation_overrides={"top_p": 0.8}
    )
    p = call()
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 20, 0.8, 9)
    p = call(temperature=0.0, max_tokens=100)
    assert p.temperature == 0.0 and p.max_tokens == 100
    call = _defaults_app({"max_tokens": 9}, generation_overrides={"max_new_tokens": 5})
    assert call().max_tokens == 5 and call(max_tokens=100).max_tokens == 5
    assert call(max_tokens=3).max_tokens == 3
    # --generation-config FOLDER: that folder's max_new_tokens is a cap, as in vLLM
    call = _defaults_app({"max_tokens": 9}, generation_config="/models/gen")
    assert call(max_tokens=100).max_tokens == 9


def test_vllm_api_key_env_is_honoured(monkeypatch):
    from helpers.tiny_models import build_tokenizer

    monkeypatch.delenv("QWENSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    args = make_serve_parser().parse_args([])
    state = ServerState(ScriptedEngine(build_tokenizer()), ServingOptions(["m"]))
    app = build_server_app(args, state, make_registry(process_metrics=False))

    async def status(key):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            headers = {"Authorization": f"Bearer {key}"}
            return (await c.get("/v1/models", headers=headers)).status_code

    assert asyncio.run(status("vllm-key")) == 200
    assert asyncio.run(status("other")) == 401


def test_request_id_headers():
    """--enable-request-id-headers: the client's X-Request-Id comes back (and names the
    completion), or a fresh one when it sent none; without the flag no header is added."""
    from helpers.tiny_models import build_tokenizer

    def app_for(argv):
        state = ServerState(ScriptedEngine(build_tokenizer()), ServingOptions(["m"]))
        return build_server_app(
            make_serve_parser().parse_args(argv), state, make_registry(process_metrics=False)
        )

    async def post(app, headers):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            body = {"messages": MSG, "max_tokens": 4}
            return await c.post("/v1/chat/completions", json=body, headers=headers)

    app = app_for(["--enable-request-id-headers"])
    r = asyncio.run(post(app, {"X-Request-Id": "abc-123"}))
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "chatcmpl-abc-123"
    fresh = asyncio.run(post(app, {})).headers["x-request-id"]
    assert len(fresh) == 32 and fresh != asyncio.run(post(app, {})).headers["x-request-id"]
    assert "x-request-id" not in asyncio.run(post(app_for([]), {"X-Request-Id": "x"})).headers


class FailingEngine(ScriptedEngine):
    async def generate(self, prompt_ids, params, request_id, prompt=None):
        raise RuntimeError("secret /home/op/.cache/key")
        yield  # an async generator, as AsyncEngine.generate


def _raw_app(engine) -> httpx.AsyncClient:
    args = make_serve_parser().parse_args([])
    app = build_server_app(args, ServerState(engine, ServingOptions(["qwen3"])), make_registry(False))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def _post(client: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
    async def main() -> httpx.Response:
        async with client:
            return await client.post(path, json=body)

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_failures_carry_a_reference_not_the_exception(stream, caplog):
    from helpers.tiny_models import build_tokenizer

    client = _raw_app(FailingEngine(build_tokenizer()))
    r = _post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": stream})
    assert r.status_code == 503
    message = r.json()["error"]["message"]
    assert "reference" in message and "secret" not in r.text and "RuntimeError" not in r.text
    reference = message.split("reference ")[1].split(";")[0]
    assert reference in caplog.text and "secret /home/op" in caplog.text


def test_a_500_names_a_reference_only(monkeypatch, caplog):
    from helpers.tiny_models import build_tokenizer
    from qwenserve.entrypoints.openai import serving_completion

    def broken(*_args, **_kwargs):
        raise KeyError("sk-live-1234")

    monkeypatch.setattr(serving_completion, "prepare_completion", broken)
    r = _post(_raw_app(ScriptedEngine(build_tokenizer())), "/v1/completions", {"prompt": "Hi"})
    assert r.status_code == 500
    assert "sk-live" not in r.text and "KeyError" not in r.text and "reference" in r.text
    assert "sk-live-1234" in caplog.text


@pytest.mark.parametrize(
    ("path", "raw"),
    [("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
     ("/tokenize", b'{"prompt": "x\\ud83d"}'),
     ("/tokenize", b'{"messages": [{"role": "user", "content": "x\\ud83d"}]}')],
)  # fmt: skip
def test_lone_surrogates_are_a_400(path, raw):
    from helpers.tiny_models import build_tokenizer

    async def main() -> httpx.Response:
        async with _raw_app(ScriptedEngine(build_tokenizer())) as client:
            headers = {"content-type": "application/json"}
            return await client.post(path, content=raw, headers=headers)

    r = asyncio.run(main())
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]
