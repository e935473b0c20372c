"""INT8 W8A8 MoE experts (the ``ExpertMethod`` seam of ``layers/moe.py``).

ModelSlim W8A8_DYNAMIC experts (vLLM Ascend's ``AscendW8A8DynamicFusedMoEMethod``) and
compressed-tensors INT8 experts (vLLM's ``CompressedTensorsW8A8Int8MoEMethod``) store the same
thing: per expert an int8 ``weight`` [out, in] with one float ``weight_scale`` per output row, and
activations quantized per token at run time. One method runs both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.quantization.kernels import Int8Matmul


class Int8Experts:
    """Stacked int8 ``w13`` [E, 2I, H] / ``w2`` [E, H, I] with float32 per-row scales
    ``w13_scale`` [E, 2I, 1] / ``w2_scale`` [E, H, 1]. One expert on its tokens x [n, H]::

        x_q, s_x = per-token int8(x)          h = (x_q @ W13_q.T) * s_x * s_13    [n, 2I]
        a = silu(h_gate) * h_up               a_q, s_a = per-token int8(a)
        y = (a_q @ W2_q.T) * s_a * s_2                                             [n, H]

    Both GEMMs accumulate in int32 through the platform's int8 GEMM (``Int8Matmul``; its
    fallback dequantizes the weight on the fly, the plain-PyTorch reference). Quantizing the
    tokens per expert group equals quantizing each token once: the scale is per row."""

    quantized = True

    def __init__(self, matmul: Int8Matmul) -> None:
        self.matmul = matmul

    def create_weights(self, layer: nn.Module, num_local: int, inter: int, hidden: int,
                       dtype: torch.dtype | None) -> None:
        def param(*shape: int, dtype: torch.dtype, fill: float = 0.0) -> nn.Parameter:
            return nn.Parameter(torch.full(shape, fill, dtype=dtype), requires_grad=False)

        layer.w13 = param(num_local, 2 * inter, hidden, dtype=torch.int8)
        layer.w2 = param(num_local, hidden, inter, dtype=torch.int8)
        layer.w13_scale = param(num_local, 2 * inter, 1, dtype=torch.float32, fill=1.0)
        layer.w2_scale = param(num_local, hidden, 1, dtype=torch.float32, fill=1.0)

    def expert_mlp(self, layer: nn.Module, x: torch.Tensor, expert: int) -> torch.Tensor:
        x_q, x_scale = self.matmul.quantize(x)  # [n, H] int8, [n, 1]
        h = self.matmul(x_q, layer.w13[expert], layer.w13_scale[expert].view(-1), x_scale,
                        None, x.dtype)  # [n, 2I]
        gate, up = h.chunk(2, dim=-1)
        a_q, a_scale = self.matmul.quantize(F.silu(gate) * up)  # [n, I] int8, [n, 1]
        return self.matmul(a_q, layer.w2[expert], layer.w2_scale[expert].view(-1), a_scale,
                           None, x.dtype)  # [n, H]
