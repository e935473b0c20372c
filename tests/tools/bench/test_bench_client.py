"""The SSE parser and the request bodies (vLLM's), independent of any server."""

from __future__ import annotations

import json

import pytest

from qwenserve.tools.bench.client import RequestSpec, SSEParser, _Timer, build_payload
from qwenserve.tools.bench.metrics import RequestResult

STREAM = (
    ": ping\n\n"
    'data: {"choices": [{"text": "hé"}]}\n\n'
    "event: message\n"
    'data:{"choices": [{"text": "你"}]}\r\n\r\n'
    'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\n'
    "data: [DONE]"
).encode()


@pytest.mark.parametrize("step", [1, 2, 3, 7, len(STREAM)])
def test_parser_is_independent_of_chunking(step: int) -> None:
    parser = SSEParser()
    payloads: list[str] = []
    for i in range(0, len(STREAM), step):
        payloads += parser.feed(STREAM[i : i + step])
    payloads += parser.flush()
    assert payloads[-1] == "[DONE]" and len(payloads) == 4
    assert json.loads(payloads[0])["choices"][0]["text"] == "hé"
    assert json.loads(payloads[1])["choices"][0]["text"] == "你"  # no space after "data:"


def test_split_multibyte_character() -> None:
    raw = 'data: {"t": "你"}\n\n'.encode()
    cut = raw.index("你".encode()) + 1
    parser = SSEParser()
    assert parser.feed(raw[:cut]) == []
    assert parser.feed(raw[cut:]) == ['{"t": "你"}']


def test_completion_and_chat_bodies() -> None:
    spec = RequestSpec(api_url="http://x/v1/completions", model="m", prompt="p", prompt_len=1,
                       output_len=7, ignore_eos=True, extra_body={"temperature": 0.0})  # fmt: skip
    assert build_payload(spec) == {
        "model": "m", "prompt": "p", "max_tokens": 7, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0,
    }  # fmt: skip
    chat = RequestSpec(api_url="http://x/v1/chat/completions", model="m", prompt="p",
                       prompt_len=1, output_len=3, chat=True, logprobs=2)  # fmt: skip
    body = build_payload(chat)
    assert body["messages"] == [{"role": "user", "content": [{"type": "text", "text": "p"}]}]
    assert (
        body["max_completion_tokens"] == 3 and "logprobs" not in body and "ignore_eos" not in body
    )


def test_serve_client_imports_no_torch() -> None:
    """``bench serve`` is a pure HTTP client: it must start where torch is not installed."""
    import subprocess
    import sys

    code = (
        "import sys; from qwenserve.entrypoints.cli import build_parser; "
        "sys.argv = ['qwenserve', 'bench', 'serve']; build_parser('bench'); "
        "import qwenserve.tools.bench.serve, qwenserve.tools.bench.sweep; "
        "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def feed_timer(chat: bool, events: list[tuple[float, dict]]) -> RequestResult:
    """Run vLLM's timing rules over (arrival time, chunk) pairs; the POST leaves at t = 10."""
    result = RequestResult(prompt_len=3)
    timer = _Timer(result, start=10.0, chat=chat)
    for now, data in events:
        timer.on_chunk(data, now)
    result.latency = timer.last - timer.start
    return result


@pytest.mark.parametrize("chat", [False, True])
def test_timing_ends_at_the_last_token_chunk(chat: bool) -> None:
    """TTFT 0.5, gaps 0.25 and 0.5; the usage chunk 2 s later moves neither E2EL nor ITL."""
    choice = {"delta": {"content": "a"}} if chat else {"text": "a"}
    usage = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3}}
    r = feed_timer(chat, [(10.5, {"choices": [choice]}), (10.75, {"choices": [choice]}),
                          (11.25, {"choices": [choice]}), (13.25, usage)])  # fmt: skip
    assert r.ttft == 0.5 and r.itl == [0.25, 0.5] and r.latency == 1.25
    # the server's usage replaces the client's counts, as vLLM's request functions do
    assert (r.output_tokens, r.prompt_len) == (3, 11)


def test_usage_without_prompt_tokens_keeps_the_client_count() -> None:
    r = feed_timer(False, [(10.5, {"choices": [{"text": "a"}]}),
                           (10.6, {"choices": [], "usage": {"completion_tokens": 1}})])  # fmt: skip
    assert (r.output_tokens, r.prompt_len) == (1, 3)
