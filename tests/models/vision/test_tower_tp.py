"""The vision tower split over two CPU ranks (gloo) gives the single-rank result."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from helpers.ports import free_port
from helpers.tiny_vision import hf_vision_model, random_pixels, vision_config
from helpers.tp_vision import run_rank
from qwenserve.models.vision.tower import Qwen3VisionTower

GRIDS = [(1, 4, 6), (1, 2, 2), (1, 8, 4)]


def test_tp2_equals_tp1(tmp_path):
    hf = hf_vision_model("qwen3_vl", seed=5)
    weights, inputs, out = tmp_path / "w.pt", tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(hf.state_dict(), weights)
    pixels = random_pixels(GRIDS, seed=6)
    torch.save((pixels, GRIDS), inputs)
    mp.spawn(run_rank, args=(2, free_port(), "qwen3_vl", str(weights), str(inputs), str(out)),
             nprocs=2, join=True)
    sharded = torch.load(out)
    single = Qwen3VisionTower(vision_config("qwen3_vl"), torch.float32)
    single.load_weights(hf.state_dict().items())
    with torch.no_grad():
        expected = single(pixels, GRIDS)
    assert len(sharded) == 1 + len(expected.deepstack) == 3
    for got, want in zip(sharded, [expected.embeds, *expected.deepstack]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
