"""A vision tower run on each rank of a CPU (gloo) tensor-parallel group, for the TP tests."""

from __future__ import annotations

import socket

import torch

from helpers.tiny_vision import vision_config


def run_rank(rank: int, world_size: int, port: int, family: str, weights_path: str,
             inputs_path: str, out_path: str) -> None:
    """Build the tower sharded ``world_size`` ways, run it, and save rank 0's output."""
    from qwenserve.distributed.init import (
        LOOPBACK,
        Rendezvous,
        init_parallel_group,
        leave_parallel_group,
    )
    from qwenserve.models.vision.tower import Qwen3VisionTower

    torch.set_num_threads(1)
    # Rank 0 serves the store on a socket it binds itself (the engine's parent holds it instead).
    listener = socket.create_server((LOOPBACK, port)) if rank == 0 else None
    tp = init_parallel_group("gloo", rank, Rendezvous(LOOPBACK, port, world_size), listener,
                             timeout_s=120)
    cfg = vision_config(family)
    tower = Qwen3VisionTower(cfg, torch.float32, tp)
    assert tower.blocks[0].attn.num_heads == cfg.num_heads // world_size  # really sharded
    tower.load_weights(torch.load(weights_path).items())
    pixels, grids = torch.load(inputs_path)
    with torch.no_grad():
        out = tower(pixels, grids)
    if rank == 0:
        torch.save([out.embeds, *out.deepstack], out_path)
    leave_parallel_group(tp)  # meet first: a rank tearing gloo down under its peer aborts
