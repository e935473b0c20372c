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
