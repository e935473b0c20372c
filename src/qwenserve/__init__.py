"""qwenserve: a vLLM-compatible inference server for Qwen-family models.

The public names are imported lazily so that ``import qwenserve`` stays light (no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "qwenserve.entrypoints.llm",
    "SamplingParams": "qwenserve.sampling_params",
    "StructuredOutputsParams": "qwenserve.sampling_params",
    "RequestOutput": "qwenserve.outputs",
    "CompletionOutput": "qwenserve.outputs",
    "EngineArgs": "qwenserve.engine.arg_utils",
    "AsyncEngine": "qwenserve.engine.async_engine",
}

__all__ = [*_LAZY, "__version__"]

if TYPE_CHECKING:
    from qwenserve.engine.arg_utils import EngineArgs
    from qwenserve.engine.async_engine import AsyncEngine
    from qwenserve.entrypoints.llm import LLM
    from qwenserve.outputs import CompletionOutput, RequestOutput
    from qwenserve.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'qwenserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
