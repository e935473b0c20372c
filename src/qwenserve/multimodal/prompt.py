"""From a tokenized prompt with one placeholder per image to the prompt the model runs.

The chat template (or the user, in ``LLM.generate``) writes one
``<|vision_start|><|image_pad|><|vision_end|>`` per image; each ``<|image_pad|>`` then becomes as
many copies as the image has tokens, as HF's processor does on text:

    [.., vs, PAD, ve, ..]  + image of 2 x 3 tokens  ->  [.., vs, PAD x 6, ve, ..]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qwenserve.multimodal.inputs import (
    ImagePlacement,
    mrope_position_delta,
    num_image_tokens,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


@dataclass(frozen=True)
class ImagePromptFormat:
    """The model's image tokens, and the text a chat renders for one image."""

    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    placeholder: str  # e.g. "<|vision_start|><|image_pad|><|vision_end|>"

    @classmethod
    def from_config(cls, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> ImagePromptFormat:
        ids = [int(getattr(hf_config, name)) for name in
               ("image_token_id", "vision_start_token_id", "vision_end_token_id")]
        start, pad, end = tokenizer.convert_ids_to_tokens([ids[1], ids[0], ids[2]])
        if None in (start, pad, end):
            raise ValueError(f"the tokenizer has no tokens for the config's image token ids "
                             f"{ids}; does the tokenizer belong to this model?")
        return cls(ids[0], ids[1], ids[2], f"{start}{pad}{end}")


@dataclass(frozen=True)
class MultiModalPrompt:
    """A prompt with its images placed: plain data the engine keeps with the request."""

    token_ids: list[int]
    placements: list[ImagePlacement]
    mrope_position_delta: int


def expand_image_tokens(token_ids: Sequence[int], image_token_id: int,
                        grids: Sequence[tuple[int, int, int]], content_hashes: Sequence[str],
                        merge_size: int) -> MultiModalPrompt:
    """Replace the i-th image token by image i's tokens; the counts must match."""
    found = sum(1 for t in token_ids if t == image_token_id)
    if found != len(grids):
        raise ValueError(f"the prompt has {found} image placeholder(s) but {len(grids)} "
                         f"image(s) were given; write one <|vision_start|><|image_pad|>"
                         "<|vision_end|> per image, where the image belongs")
    expanded: list[int] = []
    placements: list[ImagePlacement] = []
    images = iter(zip(grids, content_hashes))
    for token in token_ids:
        if token != image_token_id:
            expanded.append(token)
            continue
        grid, content_hash = next(images)
        placements.append(ImagePlacement(len(expanded), tuple(grid), merge_size, content_hash))
        expanded.extend([image_token_id] * num_image_tokens(grid, merge_size))
    return MultiModalPrompt(expanded, placements,
                            mrope_position_delta(len(expanded), placements))
