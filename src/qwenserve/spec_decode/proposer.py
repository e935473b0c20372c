"""The proposer seam: after each step, draft the next tokens of the requests just sampled.

The runner calls ``propose`` on the driver with the requests' worker-side state; the drafts go
back to the scheduler in ``ModelOutput.draft_token_ids`` and are verified in the next step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from qwenserve.spec_decode.ngram import NgramProposer


class RequestTokens(Protocol):
    """What a proposer reads of a request on the worker."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]


class Proposer(Protocol):
    def propose(self, request_ids: list[str], requests: Mapping[str, RequestTokens]
                ) -> dict[str, list[int]]:
        """Draft tokens per request id (requests without a proposal may be left out)."""


class NgramLookup:
    """Prompt lookup over each request's prompt + output (``ngram.py``)."""

    def __init__(self, min_n: int, max_n: int, num_tokens: int) -> None:
        self.ngram = NgramProposer(min_n, max_n, num_tokens)

    def propose(self, request_ids: list[str], requests: Mapping[str, RequestTokens]
                ) -> dict[str, list[int]]:
        out = {}
        for request_id in request_ids:
            state = requests[request_id]
            draft = self.ngram.propose(state.prompt_token_ids + state.output_token_ids)
            if draft:
                out[request_id] = draft
        return out
