"""Qwen3's reasoning format: ``<think>reasoning</think>answer``.

One incremental state machine serves both streaming and whole responses (a whole response is a
single delta with ``final=True``), so the two can never disagree:

    START --"<think>"--> REASONING --"</think>"--> CONTENT
      \\--(anything else)--------------------------^

While a delta ends in what may be the beginning of a tag (``"<thi"``), those characters are held
back until the next delta settles it. Where the chat template already opened the block (the
prompt ends inside ``<think>``, as Qwen3.5 and DeepSeek-R1 templates do), generation starts in
REASONING. With ``enable_thinking: false`` Qwen3's template closes an empty block in the prompt,
so the output is content unless the model opens a block itself.
"""

from __future__ import annotations

_START, _START_OPEN, _REASONING, _CONTENT = "start", "start_open", "reasoning", "content"


def partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def prompt_opens_block(prompt_text: str | None, start: str, end: str) -> bool:
    """True when the rendered prompt leaves a reasoning block open for the model to continue."""
    if not prompt_text:
        return False
    return prompt_text.rfind(start) > prompt_text.rfind(end)


class ReasoningParser:
    """Splits generated text into (reasoning, content), one delta at a time."""

    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, prompt_text: str | None = None) -> None:
        opened = prompt_opens_block(prompt_text, self.start_tag, self.end_tag)
        self._state = _START_OPEN if opened or self.implicit_start else _START
        self._buf = ""
        self.saw_reasoning = False

    implicit_start = False  # the model may omit <think> and begin with reasoning at once

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Add generated text; returns the (reasoning, content) text that is now certain."""
        self._buf += delta
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state in (_START, _START_OPEN):
                if not self._leave_start(final):
                    break
            elif self._state == _REASONING:
                if not self._take_reasoning(reasoning, final):
                    break
            else:
                content.append(self._buf)
                self._buf = ""
                break
        return "".join(reasoning), "".join(content)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """A whole output: (reasoning or None when there was no block, content or None)."""
        reasoning, content = self.feed(text, final=True)
        return (reasoning if self.saw_reasoning else None), (content or None)

    def _leave_start(self, final: bool) -> bool:
        """Decide whether the output opens with ``<think>``; False while still undecided."""
        stripped = self._buf.lstrip()
        if stripped.startswith(self.start_tag):
            self._buf = stripped[len(self.start_tag) :]
            self._state = _REASONING
        elif not final and self.start_tag.startswith(stripped):
            return False
        else:
            self._state = _REASONING if self._state == _START_OPEN else _CONTENT
        if self._state == _REASONING:
            self.saw_reasoning = True
        return True

    def _take_reasoning(self, out: list[str], final: bool) -> bool:
        index = self._buf.find(self.end_tag)
        if index >= 0:
            out.append(self._buf[:index])
            self._buf = self._buf[index + len(self.end_tag) :]
            self._state = _CONTENT
            return True
        keep = 0 if final else partial_suffix_len(self._buf, self.end_tag)
        out.append(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False


class Qwen3ReasoningParser(ReasoningParser):
    """``--reasoning-parser qwen3``: Qwen3, Qwen3-2507 thinking models, Qwen3.5."""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """``--reasoning-parser deepseek_r1`` (QwQ-32B, R1 distills): output starts in reasoning,
    whether or not the model writes ``<think>`` itself."""

    implicit_start = True
