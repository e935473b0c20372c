"""The proposer seam: after each step, draft the next tokens of the requests just sampled.

The runner calls ``propose`` on the driver with the requests' worker-side state; the drafts go
back to the scheduler in ``ModelOutput.draft_token_ids`` and are verified in the next step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from qwenserve.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    import torch

    from qwenserve.core.sched_output import ScheduledChunk
    from qwenserve.layers.forward_batch import ForwardBatch


class RequestTokens(Protocol):
    """What a proposer reads of a request on the worker."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]


class Proposer(Protocol):
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None,
                chunks: Sequence[ScheduledChunk] = ()) -> None:
        """See the step's batch (a ForwardBatch), the target's hidden states [T, H] and the
        step's chunks (ScheduledChunk, in row order) after the target ran it: a draft model
        keeps its KV in step here, the MTP head keeps the hidden states for ``propose``;
        n-gram lookup needs nothing."""

    def propose(self, request_ids: list[str], requests: Mapping[str, RequestTokens]
                ) -> dict[str, list[int]]:
        """Draft tokens per request id (requests without a proposal may be left out)."""


class VocabularyHead(Protocol):
    """A model's LM head as a drafter reads it (a ``CausalLM``, the MTP head)."""

    def compute_logits(self, hidden: torch.Tensor,
                       dtype: torch.dtype | None = ...) -> torch.Tensor: ...

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None: ...


def greedy_drafts(head: VocabularyHead, rows: torch.Tensor) -> list[int]:
    """Each row's most likely next token: the platform's fused greedy LM head where it takes
    the rows (no [rows, vocab] logits), else the logits' argmax (the same tokens)."""
    tokens = head.greedy_tokens(rows)
    return (tokens if tokens is not None else head.compute_logits(rows).argmax(-1)).tolist()


def too_many(request_ids: list[str], disable_by_batch_size: int | None) -> bool:
    """The scheduler drops drafts at this batch size (``disable_by_batch_size``): skip them."""
    return disable_by_batch_size is not None and len(request_ids) >= disable_by_batch_size


class NgramLookup:
    """Prompt lookup over each request's prompt + output (``ngram.py``)."""

    def __init__(self, min_n: int, max_n: int, num_tokens: int,
                 disable_by_batch_size: int | None = None) -> None:
        self.ngram = NgramProposer(min_n, max_n, num_tokens)
        self.disable_by_batch_size = disable_by_batch_size

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None,
                chunks: Sequence[ScheduledChunk] = ()) -> None:
        """Nothing to keep: the lookup reads the token history."""

    def propose(self, request_ids: list[str], requests: Mapping[str, RequestTokens]
                ) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        if too_many(request_ids, self.disable_by_batch_size):
            return out
        for request_id in request_ids:
            state = requests[request_id]
            draft = self.ngram.propose(state.prompt_token_ids + state.output_token_ids)
            if draft:
                out[request_id] = draft
        return out
