"""Tool-call parsers: model text -> OpenAI ``tool_calls`` (``--tool-call-parser``).

One file per format; adding one is a file and a line in ``TOOL_PARSERS``.
"""

from __future__ import annotations

from qwenserve.entrypoints.openai.tool_parsers.base import ToolCallDelta, ToolParser, merge_deltas
from qwenserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from qwenserve.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,  # Qwen2.5, Qwen3, QwQ: JSON inside <tool_call>
    "qwen3_coder": Qwen3CoderToolParser,  # Qwen3-Coder, Qwen3.5/3.6: XML inside <tool_call>
    "qwen3_xml": Qwen3CoderToolParser,  # vLLM's alias of qwen3_coder
    "qwen3_json": HermesToolParser,  # vLLM's alias of hermes
}
# vLLM's other parsers; naming one gives "not implemented yet" rather than "invalid choice".
KNOWN_VLLM_TOOL_PARSERS = (
    "apertus",
    "cohere_command3",
    "cohere_command4",
    "deepseek_v3",
    "deepseek_v31",
    "deepseek_v32",
    "deepseek_v4",
    "deepseek_v41",
    "dots",
    "ernie45",
    "functiongemma",
    "gemma4",
    "gigachat3",
    "glm45",
    "glm47",
    "granite",
    "granite-20b-fc",
    "granite4",
    "hf",
    "hunyuan_a13b",
    "hy_v3",
    "hy_v4",
    "inkling",
    "internlm",
    "jamba",
    "k2_horizon",
    "kimi_k2",
    "kimi_k3",
    "lfm2",
    "ling3",
    "llama3_json",
    "llama4_json",
    "llama4_pythonic",
    "longcat",
    "mimo",
    "minicpm5",
    "minimax",
    "minimax_m2",
    "minimax_m3",
    "mistral",
    "muse_glimmer",
    "olmo3",
    "openai",
    "phi4_mini_json",
    "plamo3",
    "poolside_v1",
    "pythonic",
    "seed_oss",
    "step3",
    "step3p5",
    "xlam",
)

__all__ = [
    "TOOL_PARSERS",
    "KNOWN_VLLM_TOOL_PARSERS",
    "ToolParser",
    "ToolCallDelta",
    "merge_deltas",
    "HermesToolParser",
    "Qwen3CoderToolParser",
]
