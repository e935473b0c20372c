"""Typed Python face of the sampling kernel (one draw per row, and per-row logprobs)."""

from __future__ import annotations

import ctypes
import os

import torch

from qwenserve.native.build import CSRC, DEFAULT_CFLAGS, FAST_MATH, load_library
from qwenserve.native.build import I64 as _I
from qwenserve.native.build import PTR as _P


class Sampling:
    """``csrc/sampling.cpp``: one draw per row of fp32 or bf16 logits (greedy, or temperature,
    min_p, top_k and top_p with a caller-given uniform per row), reading the logits in place
    (bf16 rows are widened, exactly, in cache: the same draws as for ``logits.float()``)."""

    DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the entry points' suffixes

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns, self._logprob_fns = {}, {}
        for dtype, tag in self.DTYPES.items():
            fn = getattr(lib, f"sample_rows_{tag}")
            fn.argtypes = [_P, _P, _I, _I, _I, _P, _P, _P, _P, _P]
            fn.restype = ctypes.c_int
            self._fns[dtype] = fn
            fn = getattr(lib, f"logprob_rows_{tag}")
            fn.argtypes = [_P, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P]
            fn.restype = ctypes.c_int
            self._logprob_fns[dtype] = fn

    def supports(self, logits: torch.Tensor) -> bool:
        return (logits.is_cpu and logits.dtype in self._fns and logits.dim() == 2
                and logits.stride(1) == 1 and logits.shape[1] > 0)

    def logprobs(self, logits: torch.Tensor, row_index: list[int], token_ids: list[int],
                 num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``row_index`` of logits [B, V] (``supports``): each row's token's logprob and
        rank, and its ``num_top`` best (logprobs, ids) ([n], [n], [n, k], [n, k]); ids past the
        vocabulary are refused."""
        n = len(row_index)
        rows = torch.tensor(row_index, dtype=torch.int64)
        chosen = torch.tensor(token_ids, dtype=torch.int64)
        chosen_lp, rank = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.int64)
        top_lp = torch.empty(n, num_top, dtype=torch.float32)
        top_id = torch.empty(n, num_top, dtype=torch.int64)
        if self._logprob_fns[logits.dtype](
                logits.data_ptr(), n, logits.shape[1], logits.stride(0), rows.data_ptr(),
                chosen.data_ptr(), num_top, chosen_lp.data_ptr(), rank.data_ptr(),
                top_lp.data_ptr(), top_id.data_ptr()):
            raise ValueError(f"logprob_rows: bad arguments for logits {tuple(logits.shape)} "
                             f"(token ids {token_ids}, {num_top} top)")
        return chosen_lp, rank, top_lp, top_id

    def draw(self, logits: torch.Tensor, temperature: list[float], top_k: list[int],
             top_p: list[float], min_p: list[float], uniform: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> token ids [B] int64. Per row: temperature (0: greedy), top_k (0:
        off), top_p (1: off), min_p (0: off); ``uniform`` [B] float64 in [0, 1)."""
        rows = logits.shape[0]
        assert len(temperature) == len(top_k) == len(top_p) == len(min_p) == rows
        assert uniform.dtype == torch.float64 and uniform.shape == (rows,)
        temps = torch.tensor(temperature, dtype=torch.float32)
        ks = torch.tensor(top_k, dtype=torch.int64)
        ps = torch.tensor(top_p, dtype=torch.float32)
        mins = torch.tensor(min_p, dtype=torch.float32)
        u = uniform.contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        if self._fns[logits.dtype](out.data_ptr(), logits.data_ptr(), rows, logits.shape[1],
                                   logits.stride(0), temps.data_ptr(), ks.data_ptr(),
                                   ps.data_ptr(), mins.data_ptr(), u.data_ptr()):
            raise ValueError(f"sample_rows: unsupported logits of shape {tuple(logits.shape)}")
        return out


def sampling() -> Sampling | None:
    """The sampling kernel, or None (logged) where it cannot be built."""
    lib = load_library("qwenserve_sampling", [os.path.join(CSRC, "sampling.cpp")],
                       cflags=(*DEFAULT_CFLAGS, *FAST_MATH))
    return None if lib is None else Sampling(lib)
