"""Images inside a step: run the vision tower once per image, place its rows in the batch, and
give every token its M-RoPE position.

    batch rows    [ decode A | chunk of B ................ | chunk of C ]
    B's chunk     t t I I I I t t I I                          (cuts B's second image)
    rows          .  .  4 5 6 7 .  .  10 11                    -> MultiModalBatch.rows
    embeds        image 0 tokens [0, 4), image 1 tokens [0, 2)  (from the encoder cache)

The encoder cache is keyed by the image's content hash, so two requests sending the same picture
share one encoder run. A request holds an image from the chunk that first reaches it until the
chunk that computes its last token (or until it is preempted or finished); an output nobody holds
is dropped. This is the rule ``core/encoder_budget.py`` charges the step's encoder budget by.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from qwenserve.core.sched_output import ScheduledChunk
from qwenserve.layers.forward_batch import MultiModalBatch
from qwenserve.models.vision.tower import VisionOutput
from qwenserve.multimodal.inputs import MultiModalInputs, image_slices
from qwenserve.multimodal.mrope import positions_for_range, prompt_mrope

# pixel values [N, patch_dim] of several images and their grids -> the tower's output
Encoder = Callable[[torch.Tensor, list[tuple[int, int, int]]], VisionOutput]


@dataclass
class RequestImages:
    """One request's images on this worker: its inputs and prompt M-RoPE positions."""

    inputs: MultiModalInputs
    prompt_positions: torch.Tensor  # [3, num_prompt_tokens]
    held: set[str] = field(default_factory=set)  # content hashes this request holds

    @classmethod
    def build(cls, inputs: MultiModalInputs, num_prompt_tokens: int) -> RequestImages:
        positions, delta = prompt_mrope(num_prompt_tokens, inputs.placements)
        if delta != inputs.mrope_position_delta:
            raise ValueError(f"the request's M-RoPE delta {inputs.mrope_position_delta} does "
                             f"not match its image placements ({delta})")
        return cls(inputs, positions)


class EncoderCache:
    """Vision-tower outputs by image content hash, kept while some request holds them."""

    def __init__(self) -> None:
        self.outputs: dict[str, VisionOutput] = {}
        self.holders: dict[str, set[str]] = {}

    def hold(self, content_hash: str, request_id: str) -> None:
        self.holders.setdefault(content_hash, set()).add(request_id)

    def release(self, content_hash: str, request_id: str) -> None:
        holders = self.holders.get(content_hash)
        if holders is None:
            return
        holders.discard(request_id)
        if not holders:
            del self.holders[content_hash]
            self.outputs.pop(content_hash, None)

    def release_all(self, request_id: str, images: RequestImages) -> None:
        for content_hash in images.held:
            self.release(content_hash, request_id)
        images.held.clear()


# content hash -> (pixel values, patch grid, number of language-model tokens)
NeededImages = dict[str, tuple[torch.Tensor, tuple[int, int, int], int]]


def encode_missing(cache: EncoderCache, needed: NeededImages, encoder: Encoder,
                   device: torch.device) -> None:
    """Encode the images not in the cache in one tower call (a varlen batch of images)."""
    todo = [h for h in needed if h not in cache.outputs]
    if not todo:
        return
    pixels = torch.cat([needed[h][0] for h in todo]).to(device)
    grids = [needed[h][1] for h in todo]
    out = encoder(pixels, grids)
    for content_hash, image_out in zip(todo, out.split([needed[h][2] for h in todo])):
        cache.outputs[content_hash] = image_out


def build_mm_batch(chunks: Sequence[ScheduledChunk], images: dict[str, RequestImages],
                   cache: EncoderCache, encoder: Encoder | None,
                   device: torch.device) -> MultiModalBatch | None:
    """Image rows of this step's chunks (in the batch order of ``ModelRunner._prepare``) and
    the step's ``[3, T]`` positions; None when no request of the step has images."""
    if not any(c.request_id in images for c in chunks):
        return None
    needed: NeededImages = {}
    placed: list[tuple[int, str, int, int]] = []  # (batch row, hash, image token start, end)
    positions: list[torch.Tensor] = []
    row = 0
    for c in chunks:
        start, end = c.start_pos, c.start_pos + len(c.token_ids)
        req = images.get(c.request_id)
        if req is None:
            positions.append(torch.arange(start, end).expand(3, -1))
        else:
            positions.append(positions_for_range(req.prompt_positions,
                                                 req.inputs.mrope_position_delta, start, end))
            for s in image_slices(req.inputs.placements, start, end):
                image = req.inputs.images[s.image_index]
                num_tokens = req.inputs.placements[s.image_index].num_tokens
                needed[image.content_hash] = (image.pixel_values, image.grid_thw, num_tokens)
                placed.append((row + s.chunk_offset, image.content_hash, s.token_start,
                               s.token_end))
                if image.content_hash not in req.held:
                    cache.hold(image.content_hash, c.request_id)
                    req.held.add(image.content_hash)
        row += len(c.token_ids)
    if needed and encoder is None:
        raise ValueError("a request has images but the model has no vision tower")
    if needed:
        encode_missing(cache, needed, encoder, device)
    batch = _gather(placed, cache, torch.cat(positions, dim=1).to(device), device)
    _release_finished(chunks, images, cache)
    return batch


def _gather(placed: list[tuple[int, str, int, int]], cache: EncoderCache,
            positions: torch.Tensor, device: torch.device) -> MultiModalBatch:
    rows, embeds, deepstack = [], [], []
    for first_row, content_hash, lo, hi in placed:
        out = cache.outputs[content_hash]
        rows.append(torch.arange(first_row, first_row + hi - lo))
        embeds.append(out.embeds[lo:hi])
        deepstack.append([d[lo:hi] for d in out.deepstack])
    if not rows:
        return MultiModalBatch(positions)
    depth = len(deepstack[0])
    return MultiModalBatch(
        positions,
        rows=torch.cat(rows).to(device),
        embeds=torch.cat(embeds),
        deepstack=[torch.cat([d[i] for d in deepstack]) for i in range(depth)])


def _release_finished(chunks: Sequence[ScheduledChunk], images: dict[str, RequestImages],
                      cache: EncoderCache) -> None:
    """Drop holds on images whose last token this step computes."""
    for c in chunks:
        req = images.get(c.request_id)
        if req is None:
            continue
        end = c.start_pos + len(c.token_ids)
        for placement, image in zip(req.inputs.placements, req.inputs.images):
            if placement.end <= end and image.content_hash in req.held:
                # another image of the same request with the same content may still need it
                if any(p.end > end and i.content_hash == image.content_hash
                       for p, i in zip(req.inputs.placements, req.inputs.images)):
                    continue
                cache.release(image.content_hash, c.request_id)
                req.held.discard(image.content_hash)
