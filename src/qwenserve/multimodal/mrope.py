"""M-RoPE position ids (temporal, height, width) for a prompt with images, and for what follows.

Text advances all three rows together; an image's tokens take their (t, h, w) grid coordinates
offset by the position where the image starts, and the text after it continues from
``start + max(h, w)`` (Qwen3-VL / Qwen3.5, as HF's ``get_rope_index``):

    tokens     a  b  [img 2x3 tokens ]  c  d
    temporal   0  1  2  2  2  2  2  2   5  6
    height     0  1  2  2  2  3  3  3   5  6
    width      0  1  2  3  4  2  3  4   5  6       delta = (6 + 1) - 10 = -3

Token ``i`` at or after the prompt's end (decode, or outputs recomputed after preemption) has
position ``i + delta`` on every row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qwenserve.multimodal.inputs import ImagePlacement, check_placements, mrope_position_delta


def image_positions(image: ImagePlacement, start: int) -> torch.Tensor:
    """[3, num_tokens] positions of one image's tokens, row-major over its token grid."""
    t, h, w = image.llm_grid_thw
    grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(grid).reshape(3, -1) + start


def mrope_positions(num_tokens: int, placements: Sequence[ImagePlacement]) -> torch.Tensor:
    """[3, num_tokens] M-RoPE positions of a whole prompt."""
    check_placements(placements, num_tokens)
    parts, position, cursor = [], 0, 0
    for image in placements:
        text_len = image.offset - cursor
        parts.append(torch.arange(position, position + text_len).expand(3, -1))
        position += text_len
        parts.append(image_positions(image, position))
        _, h, w = image.llm_grid_thw
        position += max(h, w)
        cursor = image.end
    parts.append(torch.arange(position, position + num_tokens - cursor).expand(3, -1))
    return torch.cat(parts, dim=1)


def positions_for_range(prompt_positions: torch.Tensor, delta: int, start: int,
                        end: int) -> torch.Tensor:
    """[3, end - start] positions of tokens ``[start, end)`` of prompt + outputs.

    A prefill chunk slices the prompt's positions; tokens past the prompt (decodes, or a
    preempted request's outputs being recomputed) are ``i + delta`` on every row.
    """
    num_prompt = prompt_positions.shape[1]
    head = prompt_positions[:, start:min(end, num_prompt)]
    if end <= num_prompt:
        return head
    tail = torch.arange(max(start, num_prompt), end).expand(3, -1) + delta
    return torch.cat((head, tail), dim=1)


def prompt_mrope(num_tokens: int,
                 placements: Sequence[ImagePlacement]) -> tuple[torch.Tensor, int]:
    """A prompt's positions and its delta, computed once when the request arrives."""
    return mrope_positions(num_tokens, placements), mrope_position_delta(num_tokens, placements)
