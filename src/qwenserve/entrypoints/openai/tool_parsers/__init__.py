"""Tool-call parsers: model text -> OpenAI ``tool_calls`` (``--tool-call-parser``)."""

from __future__ import annotations

from qwenserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser

TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}
# vLLM's other parsers; naming one gives "not implemented yet" rather than "invalid choice".
KNOWN_VLLM_TOOL_PARSERS = (
    "qwen3_coder",
    "qwen3_xml",
    "llama3_json",
    "llama4_json",
    "llama4_pythonic",
    "mistral",
    "pythonic",
    "granite",
    "granite-20b-fc",
    "internlm",
    "jamba",
    "deepseek_v3",
    "deepseek_v31",
    "kimi_k2",
    "glm45",
    "hunyuan_a13b",
    "minimax",
    "openai",
    "phi4_mini_json",
    "xlam",
    "step3",
    "seed_oss",
)

__all__ = ["TOOL_PARSERS", "KNOWN_VLLM_TOOL_PARSERS", "HermesToolParser"]
