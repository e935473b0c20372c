"""Reasoning parsers: split ``<think>...</think>`` text from the answer (``--reasoning-parser``)."""

from __future__ import annotations

from qwenserve.entrypoints.openai.reasoning.qwen3 import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}
# vLLM's other parsers; naming one gives "not implemented yet" rather than "invalid choice".
KNOWN_VLLM_REASONING_PARSERS = (
    "deepseek_v3",
    "glm45",
    "granite",
    "hunyuan_a13b",
    "mistral",
    "gpt_oss",
    "seed_oss",
    "kimi_k2",
    "minimax_m2",
    "ernie45",
    "step3",
    "olmo3",
)

__all__ = [
    "REASONING_PARSERS",
    "KNOWN_VLLM_REASONING_PARSERS",
    "ReasoningParser",
    "Qwen3ReasoningParser",
    "DeepSeekR1ReasoningParser",
]
