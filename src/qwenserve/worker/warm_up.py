"""Each GEMM weight's first call at load time, not in the first request's.

A platform may prepare a weight at its first GEMM and keep the result: on CPU, oneDNN's packed
copy of every bf16, float32 and int8 weight (``platforms/cpu_packed_gemm.py``), ~2 s for a 0.5B
model's 0.9 GB. Left to the first step, that time landed in the first requests' TTFT and in
offline throughput, where vLLM packs during its start-up. A decode-sized batch of rows through
each linear layer's GEMM and the LM head's, on this rank only (no collective), moves it into
loading.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from qwenserve.layers.embedding import ParallelLMHead
from qwenserve.layers.linear import LinearBase
from qwenserve.platforms.base import EVERY_ROW

if TYPE_CHECKING:
    from qwenserve.platforms.base import Platform


def warm_up_rows(platform: Platform, dtype: torch.dtype, int8: bool = False) -> int:
    """Rows of the warm-up call for activations in ``dtype``: one past every native kernel that
    reads the plain weight in place (the skinny GEMMs, bf16's AMX GEMM, int8's skinny rows of a
    W8A8 layer), so the call reaches the GEMM that keeps a prepared copy. On CPU: 97 bf16 rows,
    5 float32 (below the 16-64 that the native float32 GEMM takes on AVX512 CPUs, where oneDNN
    keeps packed float32 copies); one row where nothing is prepared (CUDA, NPU).
    tests/worker/test_warm_up.py checks the windows."""
    if dtype == torch.bfloat16:
        plain = [platform.bf16_skinny_gemm_max_rows, platform.amx_gemm_max_rows]
    else:
        plain = [platform.skinny_gemm_max_rows]
    if int8 and platform.int8_skinny_max_rows() != EVERY_ROW:  # (AVX2: native at every row)
        plain += [platform.int8_skinny_max_rows(), platform.amx_int8_max_rows]
    return max(plain) + 1


@torch.inference_mode()
def warm_up_gemms(model: nn.Module, dtype: torch.dtype, device: torch.device, rows: int) -> int:
    """Run ``rows`` rows of activations (``dtype``; ``warm_up_rows``) through the GEMM of every
    linear layer and LM head of ``model``'s language part (a vision tower's weights stay as they
    are until an image comes: text-only serving would carry their prepared copies for nothing);
    returns how many GEMMs ran."""
    count = 0
    for name, module in model.named_modules():
        if name == "visual" or name.startswith("visual."):
            continue
        if isinstance(module, LinearBase):
            x = torch.full((rows, module.input_size), 0.01, dtype=dtype, device=device)
            module.quant_method.apply(module, x, None)
        elif isinstance(module, ParallelLMHead):
            module.local_logits(torch.full((rows, module.weight.shape[1]), 0.01,
                                           dtype=dtype, device=device))
        else:
            continue
        count += 1
    return count
