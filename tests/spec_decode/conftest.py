"""Fixtures for the speculative-decoding tests, and one torch thread for them: their models are
tiny, so a second thread only adds fork/join and spin time (measured on the loaded 2-core VM,
test_draft_model[same]: 8.5 s of CPU and 20 s wall with one thread, 24.8 s and 83 s with two;
the same finding as tests/quantization/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.threads import one_thread_per_rank  # noqa: F401


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
