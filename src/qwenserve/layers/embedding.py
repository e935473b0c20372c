"""Vocabulary-parallel token embedding and LM head.

Rank r holds rows ``[r * V/tp, (r+1) * V/tp)`` of the [V, H] table. The embedding looks up its own
rows, zeroes the others and all-reduces; the head computes its slice of the logits and gathers.

``--quantization int8`` stores the table as int8 rows with one float32 scale each
(``quantize_vocab_tables``): for small Qwen models with tied embeddings the table is a third of the
weights or more, so leaving it float would keep the model at ~0.45x of its float32 size. Lookups
dequantize the rows they read; the head runs the int8 GEMM like any linear layer (per-row scales
are per-output-channel scales of the head).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.distributed.parallel_group import SINGLE, ParallelGroup
from qwenserve.layers.linear import copy_checked
from qwenserve.layers.native_gemm import GreedyHeadFn


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.num_per_rank = tp.shard(vocab_size, "vocab_size")
        self.vocab_start = tp.rank * self.num_per_rank
        self.weight = nn.Parameter(torch.empty(self.num_per_rank, hidden_size, dtype=dtype),
                                   requires_grad=False)  # [V/tp, H]
        self.weight.weight_loader = self.weight_loader
        self.weight_scale: nn.Parameter | None = None  # [V/tp, 1] float32 once int8
        self.int8_matmul = None

    def use_int8(self, weight_q: torch.Tensor, scale: torch.Tensor, matmul) -> None:
        """Replace the float table by int8 rows [V/tp, H] and their scales [V/tp, 1]."""
        self.weight = nn.Parameter(weight_q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.int8_matmul = matmul

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight)
        if self.weight_scale is None:
            return rows
        return (rows.to(torch.float32) * self.weight_scale[ids]).to(self.dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(param.data, loaded.narrow(0, self.vocab_start, self.num_per_rank))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_per_rank)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; ``tie_to`` shares the embedding table (tied embeddings)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp: ParallelGroup = SINGLE, tie_to: VocabParallelEmbedding | None = None,
                 float_linear: Callable[..., torch.Tensor] = F.linear,
                 greedy_head: GreedyHeadFn | None = None):
        super().__init__(vocab_size, hidden_size, dtype, tp)
        self.float_linear = float_linear  # the platform's float GEMM (``Backends.float_linear``)
        self.greedy_head = greedy_head  # ``Backends.greedy_head``
        if tie_to is not None:
            self.weight = tie_to.weight

    def compute_logits(self, hidden: torch.Tensor,
                       dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """[num_tokens, H] -> [num_tokens, V] logits in ``dtype`` (None: as the GEMM gives
        them, the model's dtype, or float32 for an int8 head)."""
        logits = self.tp.all_gather(self.local_logits(hidden), dim=-1)
        return logits if dtype is None else logits.to(dtype)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, H] -> [n] int64: ``compute_logits(hidden, None).argmax(-1)`` (the first of equal
        maxima) from the platform's fused kernel, without the [n, V] logits; None where it
        does not take the call (no kernel, an int8 table, a vocabulary split over ranks: the
        gather's collective must run on every rank)."""
        if self.greedy_head is None or self.weight_scale is not None or self.tp.world_size != 1:
            return None
        return self.greedy_head(hidden, self.weight)

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary shard of the logits (the GEMM alone, no collective)."""
        if self.weight_scale is None:
            return self.float_linear(hidden, self.weight)
        hidden_q, token_scale = self.int8_matmul.quantize(hidden)
        return self.int8_matmul(hidden_q, self.weight, self.weight_scale.view(-1), token_scale,
                                None, torch.float32)


def quantize_vocab_tables(model: nn.Module, matmul) -> None:
    """int8 per-row tables for every embedding and LM head of ``model``; a tied head shares the
    embedding's int8 table (quantized once)."""
    from qwenserve.quantization.kernels import quantize_weight

    quantized: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and module.weight_scale is None:
            key = module.weight.data_ptr()
            if key not in quantized:
                quantized[key] = _quantize_rows(module.weight.data, quantize_weight)
            module.use_int8(*quantized[key], matmul)


def _quantize_rows(table: torch.Tensor, quantize_weight, rows: int = 8192):
    """quantize_weight over row blocks, so the float32 temporaries stay small (a Qwen3.5 table
    is 248k rows)."""
    weight_q = torch.empty(table.shape, dtype=torch.int8, device=table.device)
    scale = torch.empty(table.shape[0], 1, device=table.device)
    for start in range(0, table.shape[0], rows):
        weight_q[start:start + rows], scale[start:start + rows] = quantize_weight(
            table[start:start + rows])
    return weight_q, scale
