"""Fixtures for the speculative-decoding tests (one torch thread: tests/conftest.py)."""

from __future__ import annotations

from helpers.threads import one_thread_per_rank  # noqa: F401
