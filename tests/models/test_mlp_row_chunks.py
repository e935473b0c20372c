"""A prefill's MLP in row chunks (``Platform.mlp_row_chunk``): the same values as all rows at
once, the chunk size reaching the model through the platform's backends."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen2Config

from qwenserve.layers.backends import Backends
from qwenserve.models.base import ModelContext
from qwenserve.models.dense import MLP
from qwenserve.platforms.cpu import CpuPlatform


def _mlp(backends: Backends, dtype: torch.dtype) -> MLP:
    cfg = Qwen2Config(hidden_size=64, intermediate_size=96)
    torch.manual_seed(0)
    mlp = MLP(ModelContext(cfg, dtype, 64, backends=backends), 96, False, "mlp")
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return mlp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("platform_kernels", [False, True])
@pytest.mark.parametrize("rows", [7, 8, 21])
def test_chunked_mlp_matches_all_rows_at_once(dtype, platform_kernels, rows):
    base = Backends.for_platform(CpuPlatform()) if platform_kernels else Backends.reference()
    whole = _mlp(dataclasses.replace(base, mlp_row_chunk=0), dtype)
    chunked = _mlp(dataclasses.replace(base, mlp_row_chunk=8), dtype)
    chunked.load_state_dict(whole.state_dict())
    x = torch.randn(rows, 64).to(dtype)
    calls = []
    run_rows = chunked._rows
    chunked._rows = lambda part: calls.append(part.shape[0]) or run_rows(part)
    want, got = whole(x), chunked(x)
    assert calls == ([8] * (rows // 8) + [rows % 8] * (rows % 8 > 0) if rows > 8 else [rows])
    assert got.shape == want.shape == (rows, 64) and got.dtype == dtype
    # row chunks only change which rows share a GEMM call: values agree to summation order
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got, want, **tol)
    # each chunk is its own GEMM: chunked rows equal those rows run alone
    torch.testing.assert_close(got[8:16], whole(x[8:16]), **tol)


def test_platform_chunk_reaches_the_backends():
    assert CpuPlatform.mlp_row_chunk > 0
    assert Backends.for_platform(CpuPlatform()).mlp_row_chunk == CpuPlatform.mlp_row_chunk
    assert Backends.reference().mlp_row_chunk == 0  # the reference runs all rows at once
