"""EngineArgs -> EngineConfig: the platform it is resolved on decides block sizes."""

from __future__ import annotations

import pytest

from qwenserve.engine.arg_utils import EngineArgs
from qwenserve.platforms.cpu import CpuPlatform


class LargeBlocksOnly(CpuPlatform):
    """A platform whose attention kernels take 128-token blocks only (as Ascend's fused ops)."""

    name = "large-blocks"
    default_block_size = 128
    supported_block_sizes = (128,)


def test_block_size_outside_the_platforms_sizes_is_refused_naming_them():
    with pytest.raises(ValueError, match=r"--block-size 16 is not supported on large-blocks; "
                                         r"use one of 128"):
        EngineArgs(model="/nowhere", block_size=16).create_engine_config(LargeBlocksOnly())


def test_default_block_size_is_the_platforms(tiny_model):
    config = EngineArgs(model=tiny_model("qwen2"), dtype="float32").create_engine_config(
        LargeBlocksOnly())
    assert config.cache.block_size == 128 and config.platform_name == "large-blocks"
    assert CpuPlatform.default_block_size == EngineArgs(
        model=tiny_model("qwen2")).create_engine_config(CpuPlatform()).cache.block_size == 16


def test_default_step_size_is_the_platforms_for_its_entry_point(tiny_model):
    """`serve` on CPU steps 1,024 tokens (a burst's first tokens come sooner), offline 2,048;
    an explicit --max-num-batched-tokens wins either way."""
    from qwenserve.entrypoints.openai.api_server import build_engine_args
    from qwenserve.entrypoints.openai.cli_args import make_serve_parser

    model = tiny_model("qwen2")

    def budget(args: EngineArgs) -> int:
        return args.create_engine_config(CpuPlatform()).scheduler.max_num_batched_tokens

    assert budget(EngineArgs(model=model)) == CpuPlatform.default_batched_tokens == 2048
    served = build_engine_args(make_serve_parser().parse_args([model]))
    assert served.usage_context == "server"
    assert budget(served) == CpuPlatform.default_served_batched_tokens == 1024
    flagged = make_serve_parser().parse_args([model, "--max-num-batched-tokens", "4096"])
    assert budget(build_engine_args(flagged)) == 4096


def test_usage_context_is_not_a_flag():
    from qwenserve.entrypoints.openai.cli_args import make_serve_parser

    with pytest.raises(SystemExit):
        make_serve_parser().parse_args(["--usage-context", "server"])
