"""Each GEMM weight's first call at load time, not in the first request's.

A platform may prepare a weight at its first GEMM and keep the result: on CPU, oneDNN's packed
copy of every bf16, float32 and int8 weight (``platforms/cpu_packed_gemm.py``), ~2 s for a 0.5B
model's 0.9 GB. Left to the first step, that time landed in the first requests' TTFT and in
offline throughput, where vLLM packs during its start-up. A decode-sized batch of rows through
each linear layer's GEMM and the LM head's, on this rank only (no collective), moves it into
loading.
"""

from __future__ import annotations

import torch
from torch import nn

from qwenserve.layers.embedding import ParallelLMHead
from qwenserve.layers.linear import LinearBase

# Rows of the warm-up call, by dtype, so that it reaches the GEMM that keeps a prepared copy:
# float32 past the 1-4 rows that a platform's skinny GEMM takes on the plain weight and below the
# 16-64 that its native float32 GEMM takes on AVX512 CPUs (where oneDNN keeps packed float32
# copies); bf16 past the 1-96 that its AMX GEMM takes on the plain weight
# (tests/worker/test_warm_up.py checks the windows).
WARM_UP_ROWS = 8
WARM_UP_ROWS_BF16 = 128


def warm_up_rows(dtype: torch.dtype) -> int:
    return WARM_UP_ROWS_BF16 if dtype == torch.bfloat16 else WARM_UP_ROWS


@torch.inference_mode()
def warm_up_gemms(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Run ``warm_up_rows(dtype)`` rows of activations (``dtype``) through the GEMM of every linear
    layer and LM head of ``model``'s language part (a vision tower's weights stay as they are
    until an image comes: text-only serving would carry their prepared copies for nothing);
    returns how many GEMMs ran."""
    count, rows = 0, warm_up_rows(dtype)
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
