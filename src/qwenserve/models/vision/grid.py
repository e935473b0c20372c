"""Per-patch indices of a packed batch of images, computed from their patch grids.

The image processor lays each image's patches out merge block by merge block (so the merger can
fuse ``merge x merge`` neighbours by a plain reshape). For a 4 x 4 grid with merge 2:

    grid (row, col)          packed order
    a b | c d                a b e f  c d g h  i j m n  k l o p
    e f | g h                \\_____/  \\_____/
    ----+----                block(0,0) block(0,1)  ...
    i j | k l
    m n | o p

Everything here maps packed index -> (row, col) in that order; a video's ``t`` frames repeat
the frame's layout ``t`` times.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Grid = tuple[int, int, int]  # (temporal, height, width) in patches


def patch_rows_cols(grid: Grid, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every packed patch of one image, each ``[t * h * w]``."""
    t, h, w = grid
    if h % merge or w % merge:
        raise ValueError(f"patch grid {grid} is not divisible by spatial_merge_size {merge}")
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    # block-major order: (block_row, block_col, in_row, in_col)
    rows = rows.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    cols = cols.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    return rows, cols


def rotary_positions(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """[N, 2] (row, col) of every patch of the batch: the 2-D rotary embedding's positions."""
    pairs = [torch.stack(patch_rows_cols(g, merge), dim=-1) for g in grids]
    return torch.cat(pairs) if pairs else torch.zeros(0, 2, dtype=torch.long)


def pos_embed_taps(grids: Sequence[Grid], merge: int,
                   side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) taps into a learned ``side x side`` position table, resampled to
    each image's grid: indices ``[N, 4]`` into the flat table and weights ``[N, 4]`` (fp32).

    Row ``r`` of an ``h``-row grid samples the table at ``r * (side - 1) / (h - 1)``; the four
    taps are (floor, floor) (floor, floor+1) (floor+1, floor) (floor+1, floor+1).
    """
    indices, weights = [], []
    for grid in grids:
        rows, cols = patch_rows_cols(grid, merge)
        r0, r1, wr0, wr1 = _axis_taps(rows, grid[1], side)
        c0, c1, wc0, wc1 = _axis_taps(cols, grid[2], side)
        indices.append(torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0,
                                    r1 * side + c1], dim=-1))
        weights.append(torch.stack([wr0 * wc0, wr0 * wc1, wr1 * wc0, wr1 * wc1], dim=-1))
    if not indices:
        return torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4)
    return torch.cat(indices), torch.cat(weights)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, ...]:
    """The two taps along one axis and their weights (the linear hat ``1 - distance``)."""
    source = index.float() * (side - 1) / max(size - 1, 1)  # fp32, as F.interpolate computes
    floor = source.floor()
    low = floor.long().clamp(0, side - 1)
    high = (floor.long() + 1).clamp(0, side - 1)
    frac = source - floor
    return low, high, 1 - frac, 1 - (frac - 1).abs()


def frame_cu_seqlens(grids: Sequence[Grid]) -> list[int]:
    """Boundaries of the attention segments: every frame of every image attends only to itself."""
    bounds = [0]
    for t, h, w in grids:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds
