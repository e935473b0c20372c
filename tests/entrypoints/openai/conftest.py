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
    MAX_MODEL_LEN,
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
