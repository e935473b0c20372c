"""Fixtures for the speculative-decoding tests."""

from __future__ import annotations

from helpers.threads import one_thread_per_rank  # noqa: F401
