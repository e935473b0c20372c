"""Speculative-decoding counters of one step (plain data; vLLM's ``SpecDecodingStats``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verified requests with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted tokens by draft position: index j counts drafts whose token j was accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend(
                [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos)))
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    def merge(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for pos, count in enumerate(other.num_accepted_tokens_per_pos):
            if pos == len(self.num_accepted_tokens_per_pos):
                self.num_accepted_tokens_per_pos.append(0)
            self.num_accepted_tokens_per_pos[pos] += count
