"""Vision tower: qwenserve's Qwen3.5 tower vs HF's ``Qwen3_5VisionModel``, same random weights.

The published tower shape (HF's ``Qwen3_5VisionConfig`` defaults: 27 blocks, hidden 1152, MLP 4304,
16 heads, patch 16, merge 2; ``--depth`` shortens it, time scales per block), 448 x 448 images
(28 x 28 patches -> 196 tokens each). Cases: one image; ``--images`` images in one varlen batch
(qwenserve) against HF's batched call and HF one image at a time. The variants alternate; prints
markdown rows (median of the repeats, min alongside: steadier on a shared machine).

    python benchmarks/vision_tower.py [--depth 27] [--images 4] [--repeats 3] [--threads N]
                                      [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from qwenserve.models.vision.tower import Qwen3VisionTower

PUBLISHED = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                 out_hidden_size=2048, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                 num_position_embeddings=2304, in_channels=3, hidden_act="gelu_pytorch_tanh")
GRID = (1, 28, 28)  # a 448 x 448 image


def build(depth: int, dtype: torch.dtype) -> tuple[torch.nn.Module, Qwen3VisionTower]:
    import transformers as tf
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    cfg = tf.Qwen3_5VisionConfig(**{**PUBLISHED, "depth": depth})
    torch.manual_seed(0)
    hf = Qwen3_5VisionModel._from_config(cfg, dtype=dtype).eval()
    from qwenserve.platforms.cpu import CpuPlatform

    # the platform's float GEMM, as the engine builds the tower (oneDNN for fp32 on CPU)
    linear = CpuPlatform().float_linear() or torch.nn.functional.linear
    ours = Qwen3VisionTower(cfg, dtype, linear=linear)
    ours.load_weights(hf.state_dict().items())
    return hf, ours


def timed(fn: Callable[[], torch.Tensor], repeats: int) -> tuple[list[float], torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - start) * 1000)
    return times, out


@torch.inference_mode()
def run_case(hf, ours, num_images: int, repeats: int, one_by_one: bool) -> dict:
    grids = [GRID] * num_images
    patches = GRID[0] * GRID[1] * GRID[2]
    dim = 3 * 2 * 16 * 16
    pixels = torch.randn(num_images * patches, dim, generator=torch.Generator().manual_seed(1))

    def hf_call() -> torch.Tensor:
        if one_by_one:
            return torch.cat([hf(hidden_states=p, grid_thw=torch.tensor([GRID])).pooler_output
                              for p in pixels.split(patches)])
        return hf(hidden_states=pixels, grid_thw=torch.tensor(grids)).pooler_output

    def ours_call() -> torch.Tensor:
        return ours(pixels, grids).embeds

    ours_call(), hf_call()  # warm-up
    ours_ms, hf_ms = [], []
    for _ in range(repeats):  # alternate so that machine noise hits both alike
        t, got = timed(ours_call, 1)
        ours_ms += t
        t, want = timed(hf_call, 1)
        hf_ms += t
    diff = float((got.float() - want.float()).abs().max())
    return {"ours": ours_ms, "hf": hf_ms, "diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=27)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    hf, ours = build(args.depth, dtype)
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, CPU, "
          f"tower depth {args.depth} (published 27), 448x448 images")
    print("| case | images | qwenserve ms | HF ms | HF / qwenserve | min ours / HF ms | max diff |")
    print("|---|---|---|---|---|---|---|")
    cases = [("one image", 1, False), ("varlen batch vs HF batched", args.images, False),
             ("varlen batch vs HF one at a time", args.images, True)]
    for name, n, one_by_one in cases:
        r = run_case(hf, ours, n, args.repeats, one_by_one)
        ours_med, hf_med = statistics.median(r["ours"]), statistics.median(r["hf"])
        print(f"| {name} | {n} | {ours_med:.0f} | {hf_med:.0f} | {hf_med / ours_med:.2f}x | "
              f"{min(r['ours']):.0f} / {min(r['hf']):.0f} | {r['diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
