"""One torch thread for these tests: their models are tiny, so a second thread buys nothing,
while on a busy CI host every multi-threaded op waits for its worker to be scheduled (measured:
this directory took 26 s with one thread and 231 s with two on a loaded 2-core machine)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
