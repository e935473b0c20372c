"""Write a ``sharded_state`` checkpoint: each rank's model built in turn in this process (no
process group: loading only slices), loaded from the original checkpoint, saved as that rank's
files (``models/sharded_state.py`` has the format)."""

from __future__ import annotations

import os

import torch

from qwenserve.logger import init_logger

logger = init_logger(__name__)


def write_sharded_state(model: str, output: str, tp: int, expert_parallel: bool = False,
                        dtype: str = "auto", max_size_bytes: int = 5 << 30) -> None:
    from qwenserve.distributed.parallel_group import ParallelGroup
    from qwenserve.engine.arg_utils import EngineArgs
    from qwenserve.models.base import ModelContext
    from qwenserve.models.loader import iter_weights
    from qwenserve.models.registry import load_model_class
    from qwenserve.models.sharded_state import copy_model_files, save_rank

    args = EngineArgs(model=model, dtype=dtype, tensor_parallel_size=tp,
                      enable_expert_parallel=expert_parallel)
    mc = args.create_engine_config().model
    if mc.quantization is not None or mc.source.is_gguf:
        raise ValueError("sharded_state is written from float safetensors checkpoints only")
    os.makedirs(output, exist_ok=True)
    cls = load_model_class(mc.architecture)
    for rank in range(tp):
        ctx = ModelContext(hf_config=mc.hf_config, dtype=getattr(torch, mc.dtype),
                           max_model_len=mc.max_model_len,
                           tp=ParallelGroup(rank=rank, world_size=tp),
                           expert_parallel=expert_parallel)
        with torch.device("cpu"):
            rank_model = cls(ctx)
        rank_model.load_weights(iter_weights(mc.source, mc.hf_config), mc.source.folder)
        save_rank(rank_model, output, rank, max_size_bytes)
        logger.info("rank %d of %d written to %s", rank, tp, output)
        del rank_model
    copy_model_files(mc.source.folder, output)
