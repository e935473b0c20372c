"""Incremental detokenization with stop strings.

Text is decoded over a short sliding window of tokens: the new text is
``decode(tokens[prefix:]) - decode(tokens[prefix:read])``, held back while it ends in an
incomplete UTF-8 character (U+FFFD), so a Chinese character or an emoji split over several byte
tokens appears whole. A few prompt tokens seed the window so that the first output token keeps its
leading space with SentencePiece tokenizers.

Stop strings are searched in the text as it grows, including across token boundaries. While a
request runs, the last ``len(longest stop) - 1`` characters are held back from streamed deltas so
that a stop string is never half-sent; the stop string itself is cut from the text.

Two decodes per token per request add up (64 streams: 128 per step), so a ``tokenizers``-backed
tokenizer is asked directly where transformers' ``decode`` would return the same text; its own
Python around the call cost 3x the decoding itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from qwenserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self._decoder = token_decoder(tokenizer)
        self.skip_special_tokens = params.skip_special_tokens
        self.tokens = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""
        self.stop = list(params.stop or [])
        self.include_stop = params.include_stop_str_in_output
        longest = max((len(s) for s in self.stop), default=0)
        self.stop_buffer = 0 if self.include_stop else max(longest - 1, 0)
        self._sent = 0  # characters of output_text already handed out as deltas

    def update(self, token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string if one now appears in the text (text is cut)."""
        before = len(self.output_text)
        for token_id in token_ids:
            self.tokens.append(token_id)
            self._decode_step()
        return self._find_stop(before)

    def _decode_step(self) -> None:
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            self.output_text += new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids, self.skip_special_tokens)

    def _find_stop(self, before: int) -> str | None:
        if not self.stop or len(self.output_text) == before:
            return None
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = max(0, before - len(stop) + 1)
            idx = self.output_text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.output_text = self.output_text[: idx + (len(stop) if self.include_stop else 0)]
        return stop

    def next_delta(self, finished: bool) -> str:
        """Text not handed out yet (holding back a possible stop-string prefix while running)."""
        end = len(self.output_text) if finished else max(
            self._sent, len(self.output_text) - self.stop_buffer)
        delta = self.output_text[self._sent : end]
        self._sent = end
        return delta

    def decode_token(self, token_id: int) -> str:
        return self._decoder([token_id], False)


Decoder = Callable[[list[int], bool], str]  # (token ids, skip special tokens) -> text


@functools.lru_cache(maxsize=8)
def token_decoder(tokenizer: PreTrainedTokenizerBase) -> Decoder:
    """``tokenizer.decode``, or the same call on its ``tokenizers`` backend where that returns
    the same text: transformers' own fast tokenizer class, which decodes with the backend and
    then only cleans up spaces (when ``clean_up_tokenization_spaces`` says so)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as Fast
    except ImportError:  # transformers 4
        from transformers import PreTrainedTokenizerFast as Fast

    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (isinstance(tokenizer, Fast) and backend is not None
            and cls._decode is Fast._decode and cls.decode is Fast.decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)
