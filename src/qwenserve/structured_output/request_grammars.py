"""RequestGrammars: the driver worker's per-request grammar state and the step's token bitmask.

Each constrained request has a row: its matcher (advanced with every sampled token, so it is
kept across preemption; a worker that never saw the request replays its output tokens), and,
with a reasoning parser on, a gate: the constraint starts once the output ends with the
reasoning block's end tag, as vLLM does. The same gate counts reasoning tokens for
``thinking_token_budget`` and, when the budget is spent, forces the end tag one token at a time.

Bitmask layout (xgrammar's): int32 [num_rows, ceil(vocab / 32)]; bit ``t % 32`` of word
``t // 32`` set = token ``t`` allowed. Rows of unconstrained requests are all ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qwenserve.logger import init_logger
from qwenserve.sampling_params import SamplingParams
from qwenserve.structured_output.backend import GrammarMatcher
from qwenserve.structured_output.service import GrammarService

logger = init_logger(__name__)


@dataclass
class _Row:
    matcher: GrammarMatcher | None
    reasoning_end: list[int]  # empty: no gate
    budget: int | None  # thinking_token_budget
    in_reasoning: bool
    num_reasoning_tokens: int = 0
    recent: list[int] = field(default_factory=list)  # the last len(reasoning_end) tokens
    forced: list[int] = field(default_factory=list)  # end-tag tokens still to force
    failed: bool = False  # the matcher refused a sampled token: stop constraining

    @property
    def constrains_next(self) -> bool:
        if self.forced:
            return True
        if self.matcher is None or self.failed or self.in_reasoning:
            return False
        return not self.matcher.is_terminated()  # done (e.g. ignore_eos): no longer constrained


class RequestGrammars:
    def __init__(self, service: Callable[[], GrammarService]) -> None:
        self._service_factory = service
        self._service: GrammarService | None = None
        self._rows: dict[str, _Row] = {}

    def has(self, request_id: str) -> bool:
        return request_id in self._rows

    def add(self, request_id: str, params: SamplingParams, output_token_ids: list[int]) -> None:
        """Track a request if it needs a mask (no-op otherwise); replay tokens it already has."""
        end = list(params.reasoning_end_token_ids or [])
        budget = params.thinking_token_budget if end else None
        if params.structured_outputs is None and budget is None:
            return
        matcher = None
        if params.structured_outputs is not None:
            service = self._get_service()
            grammar = service.compile(params.structured_outputs.to_spec())  # cached: at once
            matcher = service.backend.matcher(grammar)
        row = _Row(matcher, end, budget, in_reasoning=bool(end))
        self._rows[request_id] = row
        self._check_budget(row)
        for token_id in output_token_ids:
            self._advance(request_id, row, token_id)

    def remove(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def bitmask(self, request_ids: list[str], vocab_size: int) -> torch.Tensor | None:
        """The step's bitmask for these rows (sampling order), or None if none is constrained."""
        rows = [(i, r) for i, rid in enumerate(request_ids)
                if (r := self._rows.get(rid)) is not None and r.constrains_next]
        if not rows:
            return None
        mask = torch.full((len(request_ids), (vocab_size + 31) // 32), -1, dtype=torch.int32)
        for i, row in rows:
            if row.forced:
                mask[i] = 0
                token = row.forced[0]
                mask[i, token // 32] = _bit(token % 32)
            else:
                self._fill(request_ids[i], row, mask, i)
        return mask

    @staticmethod
    def _fill(request_id: str, row: _Row, mask: torch.Tensor, i: int) -> None:
        """The matcher's row; a backend error frees this request, never the engine."""
        assert row.matcher is not None
        try:
            row.matcher.fill_bitmask(mask, i)
        except RuntimeError as e:
            row.failed = True
            mask[i] = -1
            logger.warning("Request %s: its grammar failed (%s); its output is no longer "
                           "constrained", request_id, e)

    def accept(self, request_id: str, token_id: int) -> None:
        row = self._rows.get(request_id)
        if row is not None:
            self._advance(request_id, row, token_id)

    def _advance(self, request_id: str, row: _Row, token_id: int) -> None:
        if row.in_reasoning:
            if row.forced and row.forced[0] == token_id:
                row.forced.pop(0)
            row.num_reasoning_tokens += 1
            row.recent = (row.recent + [token_id])[-len(row.reasoning_end):]
            if row.recent == row.reasoning_end:
                row.in_reasoning, row.forced = False, []
            else:
                self._check_budget(row)
            return
        if row.matcher is None or row.failed or row.matcher.is_terminated():
            return
        if not row.matcher.accept_token(token_id):
            row.failed = True
            logger.warning("Request %s: token %d breaks its grammar (all allowed tokens were "
                           "masked out); its output is no longer constrained", request_id,
                           token_id)

    @staticmethod
    def _check_budget(row: _Row) -> None:
        """Budget spent while reasoning: force the rest of the end tag."""
        if row.budget is None or not row.in_reasoning or row.forced:
            return
        if row.num_reasoning_tokens >= row.budget:
            end = row.reasoning_end
            done = next((k for k in range(len(end) - 1, 0, -1)
                         if row.recent[-k:] == end[:k]), 0)
            row.forced = end[done:]

    def _get_service(self) -> GrammarService:
        if self._service is None:
            self._service = self._service_factory()
        return self._service


def _bit(index: int) -> int:
    """The int32 word with only bit ``index`` set (bit 31 is the sign bit)."""
    return -(2**31) if index == 31 else 1 << index
