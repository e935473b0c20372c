"""Vocabulary-parallel token embedding and LM head.

Rank r holds rows ``[r * V/tp, (r+1) * V/tp)`` of the [V, H] table. The embedding looks up its own
rows, zeroes the others and all-reduces; the head computes its slice of the logits and gathers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.distributed.parallel_group import SINGLE, ParallelGroup
from qwenserve.layers.linear import copy_checked


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.num_per_rank = tp.shard(vocab_size, "vocab_size")
        self.vocab_start = tp.rank * self.num_per_rank
        self.weight = nn.Parameter(torch.empty(self.num_per_rank, hidden_size, dtype=dtype),
                                   requires_grad=False)  # [V/tp, H]
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(param.data, loaded.narrow(0, self.vocab_start, self.num_per_rank))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; ``tie_to`` shares the embedding table (tied embeddings)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp: ParallelGroup = SINGLE, tie_to: VocabParallelEmbedding | None = None):
        super().__init__(vocab_size, hidden_size, dtype, tp)
        if tie_to is not None:
            self.weight = tie_to.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_tokens, H] -> [num_tokens, V] float32 logits."""
        logits = F.linear(hidden, self.weight)
        return self.tp.all_gather(logits, dim=-1).float()
