"""The grammar-engine seam: compile a GrammarSpec, then match one request's tokens against it.

A backend wraps a maintained library (xgrammar today; llguidance would be a second file). The
engine compiles on a thread pool (``service.GrammarService``); the driver worker holds one matcher
per constrained request (``request_grammars.RequestGrammars``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from qwenserve.structured_output.params import GrammarSpec


class GrammarError(ValueError):
    """A spec the backend cannot compile (bad schema, regex or grammar): a 400 for the client."""


class CompiledGrammar(Protocol):
    """A backend's compiled grammar; opaque outside the backend, never sent between processes."""


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, 32 tokens a word)."""

    def is_terminated(self) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile, or raise ``GrammarError`` naming the problem."""

    def matcher(self, grammar: CompiledGrammar) -> GrammarMatcher: ...
