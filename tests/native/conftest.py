"""Shared fixtures of the native-kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Each test once with one torch (OpenMP) thread and once with two."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)
