"""Shared plumbing of the offline benchmarks: engine flags, building ``LLM``, writing JSON.

The engine flags come from ``qwenserve.engine.arg_utils.EngineArgs`` (one definition for
``serve``, ``LLM`` and these tools), so ``bench throughput --max-num-seqs 64`` means exactly what it means to the
server. Everything touching the engine is imported inside functions: importing this module (for
``--help``) must not import torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from qwenserve.tools.bench.errors import BenchError, first_line


def add_engine_arguments(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Every ``EngineArgs`` flag, with ``defaults`` overriding the engine's defaults."""
    from qwenserve.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    if defaults:
        parser.set_defaults(**defaults)


def make_llm(args: argparse.Namespace) -> Any:
    """Build the in-process engine from the engine flags, as ``vllm bench`` does."""
    from qwenserve import LLM
    from qwenserve.engine.arg_utils import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    try:
        return LLM(**dataclasses.asdict(engine_args))
    except (ValueError, OSError) as e:
        raise BenchError(f"cannot start the engine: {first_line(e)}") from e


def check_fits(llm: Any, longest_total: int) -> None:
    """vLLM's pre-check: every prompt plus its output must fit ``max_model_len``.

    Without it a too-long request fails inside ``generate`` with a traceback, after the engine
    has loaded and warmed up; with it the user gets one line naming the flag to change.
    """
    max_len = int(llm.llm_engine.config.scheduler.max_model_len)
    if longest_total > max_len:
        raise BenchError(
            f"a request needs {longest_total} tokens (prompt + output) but max_model_len is "
            f"{max_len}; lower --input-len/--output-len or raise --max-model-len"
        )
