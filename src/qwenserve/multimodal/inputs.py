"""Where each image sits in a prompt: plain data (no torch), so it can travel with a request
into the scheduler and across process boundaries.

A prompt with two images after placeholder expansion (merge size 2, so an image of 4 x 6 patches
becomes 2 x 3 = 6 tokens):

    token:  <s> user <vs> I I I I I I <ve> and <vs> I I I I <ve> ?
    index:   0    1   2   3 .......8   9   10  11  12 ...15  16  17
                          ^ image 0: offset 3, 6 tokens    ^ image 1: offset 12, 4 tokens
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qwenserve.multimodal.processor import ProcessedImage


@dataclass(frozen=True)
class ImagePlacement:
    """One image's tokens in the prompt and the patch grid they come from."""

    offset: int  # index of the image's first token in the prompt
    grid_thw: tuple[int, int, int]  # patches (temporal, height, width), before merging
    merge_size: int  # spatial_merge_size: merge_size x merge_size patches -> one token
    content_hash: str  # hex digest of the decoded image (multimodal/hashing.py)

    @property
    def llm_grid_thw(self) -> tuple[int, int, int]:
        """The token grid: patches merged merge_size x merge_size."""
        t, h, w = self.grid_thw
        return t, h // self.merge_size, w // self.merge_size

    @property
    def num_tokens(self) -> int:
        t, h, w = self.llm_grid_thw
        return t * h * w

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def num_image_tokens(grid_thw: Sequence[int], merge_size: int) -> int:
    """Tokens the language model sees for an image of ``grid_thw`` patches."""
    t, h, w = grid_thw
    if h % merge_size or w % merge_size:
        raise ValueError(f"patch grid {tuple(grid_thw)} is not divisible by the merge size "
                         f"{merge_size}")
    return t * (h // merge_size) * (w // merge_size)


def check_placements(placements: Sequence[ImagePlacement], num_tokens: int) -> None:
    """Images in prompt order, inside the prompt, not overlapping."""
    previous_end = 0
    for i, image in enumerate(placements):
        if image.offset < previous_end or image.end > num_tokens:
            raise ValueError(f"image {i} spans tokens [{image.offset}, {image.end}), which "
                             f"overlaps the previous image or leaves the {num_tokens}-token "
                             "prompt")
        previous_end = image.end


def images_in_range(placements: Sequence[ImagePlacement], start: int,
                    end: int) -> list[ImagePlacement]:
    """The images with at least one token in prompt positions ``[start, end)``."""
    return [p for p in placements if p.offset < end and p.end > start]


def block_extra_key(placements: Sequence[ImagePlacement], start: int, end: int) -> bytes:
    """What a prefix-cache block key adds for the images inside it.

    Image tokens are all the same id, so the token ids alone cannot tell two images apart; the
    key of a block that holds any image token also covers those images' content hashes (in
    prompt order, with each image's first token, so swapped images key differently). Blocks
    chain, so every later block differs too.
    """
    parts = [f"{p.offset}:{p.content_hash}" for p in images_in_range(placements, start, end)]
    return ";".join(parts).encode()


def mrope_position_delta(num_tokens: int, placements: Sequence[ImagePlacement]) -> int:
    """M-RoPE's per-request offset: token ``i`` after the prompt has position ``i + delta``.

    An image of ``t x h x w`` tokens advances the position by only ``max(h, w)`` (its tokens
    share positions along the axes), so a prompt with images has ``delta < 0``; text-only
    prompts have 0. Same walk as ``multimodal.mrope.mrope_positions``, without tensors.
    """
    check_placements(placements, num_tokens)
    position, cursor, last = 0, 0, -1
    for image in placements:
        text_len = image.offset - cursor
        if text_len:
            last = max(last, position + text_len - 1)
        position += text_len
        t, h, w = image.llm_grid_thw
        last = max(last, position + max(t, h, w) - 1)
        position += max(h, w)
        cursor = image.end
    if num_tokens > cursor:
        last = max(last, position + num_tokens - cursor - 1)
    return last + 1 - num_tokens


@dataclass(frozen=True)
class ImageSlice:
    """Part of one image's tokens inside a prefill chunk."""

    image_index: int  # which image of the request
    chunk_offset: int  # row of the slice's first token, counted from the chunk's start
    token_start: int  # first of the image's own tokens in the slice
    token_end: int


def image_slices(placements: Sequence[ImagePlacement], start: int,
                 end: int) -> list[ImageSlice]:
    """The image tokens among prompt positions ``[start, end)``: a chunked prefill may cut an
    image, so a chunk can hold the tail of one image and the head of the next.

        position  0 1 2 3 4 5 6 7 8 9 10 11 12 13
        prompt    t t I I I I I I t I I  I  I  t      image 0 at 2..7, image 1 at 9..12
        chunk             [4 ................12)
        slices    image 0 tokens [2, 6) -> chunk rows [0, 4); image 1 tokens [0, 3) -> rows [5, 8)
    """
    slices = []
    for index, image in enumerate(placements):
        lo, hi = max(start, image.offset), min(end, image.end)
        if lo < hi:
            slices.append(ImageSlice(index, lo - start, lo - image.offset, hi - image.offset))
    return slices


@dataclass(frozen=True)
class MultiModalInputs:
    """A request's images as the engine needs them: where they sit in the prompt (the scheduler
    and the prefix-cache keys read this) and their processed pixels (only the workers read
    those; the scheduler passes them along untouched)."""

    placements: list[ImagePlacement]
    mrope_position_delta: int
    images: list[ProcessedImage] = field(default_factory=list, repr=False)  # per placement

    def block_extra_key(self, start: int, end: int) -> bytes:
        return block_extra_key(self.placements, start, end)
