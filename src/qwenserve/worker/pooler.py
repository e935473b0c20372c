"""The pooling runner's output for each finished prompt (``--runner pooling``; the rules are in
``qwenserve/pooling.py``): the last token's final hidden state, or the LM head's
positive-minus-negative token logit."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from qwenserve.config import PoolerConfig
from qwenserve.models.base import CausalLM


def pool(model: CausalLM, pooler: PoolerConfig, last_hidden: torch.Tensor) -> torch.Tensor:
    """last_hidden [n, H] (each prompt's last token) -> [n, H] embeddings or [n, 1] score
    logits, fp32. Every rank calls it: the LM head's all-gather is a collective."""
    if pooler.kind == "embed":
        return last_hidden.float()
    negative, positive = pooler.token_ids
    logits = model.compute_logits(last_hidden).float()  # [n, vocab]
    return (logits[:, positive] - logits[:, negative])[:, None]


def embedding_checkpoint_names(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Embedding checkpoints are saved from the bare decoder (``layers.0...``, no LM
    head): give them the causal LM's ``model.`` prefix and drop any head the pooler never uses."""
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        yield (name if name.startswith("model.") else "model." + name), tensor
