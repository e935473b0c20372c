"""Qwen2 reward models (Qwen2.5-Math-RM): the Qwen2 decoder and, instead of an LM head, a score
head ``Linear(H, H) -> ReLU -> Linear(H, num_labels)`` (both with biases) applied to every token,
as the checkpoint's own ``modeling_qwen2_rm.py`` and vLLM's ``Qwen2ForRewardModel`` do.

The head is replicated on every tensor-parallel rank (it is H x H, small beside the decoder), so
a rank's final hidden states, which are whole on every rank, score without a collective.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from qwenserve.layers.linear import ReplicatedLinear
from qwenserve.models.base import ModelContext
from qwenserve.models.qwen2 import Qwen2ForCausalLM


class RewardHead(nn.Module):
    """``score.0`` (H -> H) -> ReLU -> ``score.2`` (H -> num_labels): the checkpoint's names."""

    def __init__(self, ctx: ModelContext, num_labels: int) -> None:
        super().__init__()
        hidden = ctx.hf_config.hidden_size
        method = ctx.linear_method
        self.layers = nn.ModuleDict({
            "0": ReplicatedLinear(hidden, hidden, bias=True, dtype=ctx.dtype,
                                  quant_method=method("score.0")),
            "2": ReplicatedLinear(hidden, num_labels, bias=True, dtype=ctx.dtype,
                                  quant_method=method("score.2")),
        })

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, num_labels]"""
        return self.layers["2"](torch.relu(self.layers["0"](hidden)))


class Qwen2ForRewardModel(Qwen2ForCausalLM):
    """One reward per token (num_labels = 1, as vLLM fixes it); the pooler keeps every token's."""

    num_labels = 1

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        self.score = RewardHead(ctx, self.num_labels)

    def make_lm_head(self, ctx: ModelContext) -> None:
        return None  # the checkpoint has none; the score head replaces it

    def compute_logits(self, hidden: torch.Tensor,
                       dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        raise RuntimeError("a reward model has no LM head: it scores tokens (score_tokens)")

    def score_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] final hidden states -> [n, num_labels] raw rewards."""
        return self.score(hidden)

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterable[tuple[str, torch.Tensor]]:
        """``score.0.weight`` -> ``score.layers.0.weight``; an LM head, if saved, is unused."""
        for name, tensor in weights:
            if name.startswith("lm_head."):
                continue
            if name.startswith("score."):
                name = "score.layers." + name[len("score."):]
            yield name, tensor
