"""Fixtures of the benchmark tests: a fake SSE server, a tiny tokenizer, a CLI runner."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from bench_fake_server import FakeConfig, FakeServer  # noqa: E402

DATA_DIR = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer().start()
    yield server
    server.stop()


@pytest.fixture
def make_fake_server() -> Iterator[Callable[..., FakeServer]]:
    servers: list[FakeServer] = []

    def make(**kwargs: object) -> FakeServer:
        server = FakeServer(FakeConfig(**kwargs)).start()  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.tiny_models import build_tokenizer

    folder = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tokenizer().save_pretrained(str(folder))
    return folder


@pytest.fixture
def sharegpt_path() -> Path:
    return DATA_DIR / "sharegpt_sample.json"


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[[list[str]], tuple[int, str, str]]:
    """Run ``qwenserve <argv>`` in-process; returns (exit code, stdout, stderr)."""
    from qwenserve.entrypoints.cli import main

    def run(argv: list[str]) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(argv)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
