"""The xgrammar backend (vLLM's default): JSON schema, regex, EBNF and structural tags."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from qwenserve.structured_output.backend import GrammarError
from qwenserve.structured_output.params import GrammarSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the client needs the rest.
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")
# JSON may have whitespace between tokens (vLLM's default), but at most this much in one place:
# unbounded, a small model at temperature > 0 can loop on newlines until max_tokens. 24 covers
# pretty-printed JSON indented 2 spaces to depth 11.
MAX_JSON_WHITESPACE = 24


class XgrammarMatcher:
    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int],
                 max_threads: int = 2) -> None:
        import xgrammar

        self._xgr = xgrammar
        # vocab_size is the model's (the logits' width), which may exceed the tokenizer's.
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=max_threads,
                                                  cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> Any:
        try:
            if spec.kind in ("json", "json_object"):  # json_object: any object, as vLLM
                source = spec.source if spec.kind == "json" else '{"type": "object"}'
                separators = None if spec.any_whitespace else (",", ":")
                return self._compiler.compile_json_schema(
                    source, any_whitespace=spec.any_whitespace, separators=separators,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE if spec.any_whitespace else None)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.source)
            if spec.kind == "grammar":
                return self._compiler.compile_grammar(spec.source)
            if spec.kind == "structural_tag":
                return self._compiler.compile_structural_tag(spec.source)
        except (RuntimeError, ValueError, TypeError) as e:
            message = _CPP_PREFIX.sub("", str(e)).strip().splitlines()[0] if str(e) else ""
            raise GrammarError(f"Invalid structured outputs {spec.kind}: {message or e!r}") from e
        raise GrammarError(f"Unknown structured outputs kind {spec.kind!r}")

    def matcher(self, grammar: Any) -> XgrammarMatcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(grammar))
