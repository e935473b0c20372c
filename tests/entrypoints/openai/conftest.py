"""Real server processes for the OpenAI server tests.

One tiny random-weight Qwen2 server is shared by the whole directory (session scope): starting
servers is what costs time here. Tests that must own a process (shutdown, the default model)
start their own.
"""

from __future__ import annotations

import pytest
from oai_server import (
    ALIAS,
    API_KEY,
    LONG_CONTEXT,
    MAX_MODEL_LEN,
    ROOT,
    SERVED,
    TOOLS_TEMPLATE,
    RemoteServer,
)


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model) -> str:
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def server(tiny_model_path, tmp_path_factory) -> RemoteServer:
    """The shared server: API key, two served names, reasoning and tool parsers, a template
    with tools and thinking, and a small body limit (413 tests)."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    srv = RemoteServer(
        [
            tiny_model_path,
            "--served-model-name",
            SERVED,
            ALIAS,
            "--api-key",
            API_KEY,
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes",
            "64M",
            "--chat-template",
            TOOLS_TEMPLATE,
            "--reasoning-parser",
            "qwen3",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--max-request-body-bytes",
            "256K",
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
        ],
        log,
        api_key=API_KEY,
        env={"QWENSERVE_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def guarded(tiny_model, tmp_path_factory) -> RemoteServer:
    """Behind a path-based proxy (--root-path) with a key, a long context (tokenizing takes
    seconds), small admission caps and short HTTP timeouts: the hardening tests' server."""
    log = tmp_path_factory.mktemp("guarded") / "serve.log"
    srv = RemoteServer(
        [
            tiny_model("qwen2", max_position_embeddings=LONG_CONTEXT),
            "--served-model-name",
            SERVED,
            "--api-key",
            API_KEY,
            "--root-path",
            ROOT,
            "--dtype",
            "float32",
            "--max-model-len",
            str(LONG_CONTEXT),
            "--kv-cache-memory-bytes",
            "32M",
            "--disable-uvicorn-access-log",
            "--max-num-seqs",
            "2",
            "--max-sequences-per-request",
            "8",
            "--max-queued-sequences",
            "2",
        ],
        log,
        api_key=API_KEY,
        env={"QWENSERVE_HTTP_HEADER_TIMEOUT": "2", "QWENSERVE_HTTP_TIMEOUT_KEEP_ALIVE": "1",
             "QWENSERVE_HTTP_BODY_TIMEOUT": "2"},
    )
    yield srv
    srv.stop()
