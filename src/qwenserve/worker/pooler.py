"""The pooling runner's output for each finished prompt (``--runner pooling``; the rules are in
``qwenserve/pooling.py``): the last token's final hidden state, the LM head's
positive-minus-negative token logit, or (reward) every token's score-head output or hidden
state, gathered over the prompt's prefill chunks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from qwenserve.config import PoolerConfig
from qwenserve.models.base import CausalLM, TokenScorer


def pool(model: CausalLM, pooler: PoolerConfig, last_hidden: torch.Tensor) -> torch.Tensor:
    """last_hidden [n, H] (each prompt's last token) -> [n, H] embeddings or [n, 1] score
    logits, fp32. Every rank calls it: the LM head's all-gather is a collective."""
    if pooler.kind == "embed":
        return last_hidden.float()
    negative, positive = pooler.token_ids
    logits = model.compute_logits(last_hidden).float()  # [n, vocab]
    return (logits[:, positive] - logits[:, negative])[:, None]


def score_tokens(model: CausalLM, pooler: PoolerConfig, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [n, H] (every token of a chunk) -> [n, num_labels] raw rewards, or [n, H] hidden
    states for a causal LM served as a reward model (``--convert reward``), fp32."""
    if not pooler.num_labels:
        return hidden.float()
    if not isinstance(model, TokenScorer):
        raise TypeError(f"{type(model).__name__} has no score head for a reward pooler")
    return model.score_tokens(hidden).float()


class TokenOutputs:
    """Each reward request's per-token outputs, chunk by chunk until its prompt is done.

    Keyed by the chunk's first position, so a request preempted and recomputed from the start
    overwrites what it had instead of appending twice."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, request_id: str, start_pos: int, rows: torch.Tensor) -> None:
        parts = self._parts.setdefault(request_id, {})
        if start_pos == 0:
            parts.clear()
        parts[start_pos] = rows

    def finish(self, request_id: str) -> torch.Tensor:
        """[num_prompt_tokens, D], in position order."""
        parts = self._parts.pop(request_id)
        return torch.cat([parts[p] for p in sorted(parts)])

    def drop(self, request_id: str) -> None:
        self._parts.pop(request_id, None)


def embedding_checkpoint_names(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Embedding checkpoints are saved from the bare decoder (``layers.0...``, no LM
    head): give them the causal LM's ``model.`` prefix and drop any head the pooler never uses."""
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        yield (name if name.startswith("model.") else "model." + name), tensor
