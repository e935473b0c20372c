"""Fixtures for the doctor / diagnose / deploy tests; the factories live in ops_helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from ops_helpers import FakeAscendHost, build_ascend_host, clear_env


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opt-in (``pytestmark``) so the benchmark tests in bench/ keep their environment."""
    clear_env(monkeypatch)


@pytest.fixture
def ascend_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None) -> FakeAscendHost:
    return build_ascend_host(tmp_path, monkeypatch)
