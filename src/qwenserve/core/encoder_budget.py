"""The encoder budget: how much vision-encoder work one step may start (pure Python, no torch).

A prefill chunk that reaches an image the workers do not hold yet makes them run the vision
tower on the whole image, however few of its tokens the chunk holds. The step's encoder work is
bounded like its token work (vLLM's ``max_num_encoder_input_tokens``, by default the token
budget), counted in the image's language-model tokens. A chunk that would overrun it stops
right before the image; the image is then encoded in a later step.

Which images a chunk ``[start, end)`` must encode (the workers keep an image's encoder output
from the chunk that first reaches it until its last token is computed, and drop a request's
outputs when it is preempted):

    prompt   t t [ image 0 ] t t [ image 1 ] t
    chunk 1  [.......)                          encodes image 0 (starts inside)
    chunk 2          [...............)          image 0 is held; encodes image 1
    first chunk after admission (a prefix hit may start inside an image): every image it touches
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qwenserve.multimodal.inputs import ImagePlacement


@dataclass
class EncoderBudget:
    """Encoder tokens left in this step; ``used`` tells whether any image was scheduled yet."""

    left: int
    used: bool = False


def images_to_encode(placements: Sequence[ImagePlacement], start: int, end: int,
                     first_chunk: bool) -> list[ImagePlacement]:
    """The images whose encoder output the workers need for chunk ``[start, end)``."""
    return [p for p in placements
            if p.offset < end and p.end > start and (first_chunk or p.offset >= start)]


def fit_chunk(placements: Sequence[ImagePlacement], start: int, num_new: int,
              first_chunk: bool, budget: EncoderBudget) -> int:
    """Shorten chunk ``[start, start + num_new)`` so that its images fit the budget, and charge
    them. An image larger than the whole budget still runs alone (in a step that encodes
    nothing else), else its prompt could never be prefilled. Returns the new length (maybe 0).
    """
    for image in images_to_encode(placements, start, start + num_new, first_chunk):
        cost = image.num_tokens
        if cost > budget.left and budget.used:
            return max(image.offset - start, 0)
        budget.left -= cost
        budget.used = True
    return num_new
