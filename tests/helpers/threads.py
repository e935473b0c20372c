"""The fixture every multi-process tensor-parallel test uses (imported by the conftests)."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_thread_per_rank(monkeypatch):
    """One torch thread in this process (rank 0) and in the workers it spawns (they read
    ``OMP_NUM_THREADS`` at start): two ranks with a thread per core each oversubscribe a small
    shared CI machine, and spinning OpenMP threads then make a TP test 10-100x slower."""
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
