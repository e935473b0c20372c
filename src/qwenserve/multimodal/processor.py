"""Image preprocessing with the model's own Hugging Face image processor, used as a library.

Qwen3-VL and Qwen3.5 checkpoints name ``Qwen2VLImageProcessor(Fast)`` in
``preprocessor_config.json``: smart resize (both sides multiples of ``patch_size * merge_size``,
pixel count within ``[shortest_edge, longest_edge]``), rescale and normalize, then patches laid
out merge block by merge block, each frame repeated ``temporal_patch_size`` times. The fast
variant needs torchvision; without it ``AutoImageProcessor`` picks the PIL one, which computes
the same resize rule (and the same patch grid, so the same token counts).

``--mm-processor-kwargs`` (and a request's ``mm_processor_kwargs``) may set ``min_pixels``,
``max_pixels`` (vLLM's names for Qwen-VL) or ``size: {shortest_edge, longest_edge}``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qwenserve.multimodal.cache import LRUBytesCache
from qwenserve.multimodal.hashing import image_content_hash, processed_image_key

if TYPE_CHECKING:
    import torch
    from PIL import Image

SUPPORTED_PROCESSOR_KWARGS = ("min_pixels", "max_pixels", "size")


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the vision tower takes it."""

    pixel_values: torch.Tensor  # [num_patches, channels * temporal_patch * patch * patch], fp32
    grid_thw: tuple[int, int, int]  # patches (temporal, height, width)
    content_hash: str


def resolve_processor_kwargs(*layers: Mapping[str, Any] | None) -> dict[str, Any]:
    """Merge server-wide then per-request kwargs into ``{"size": {...}}`` (later layers win).

    ``min_pixels``/``max_pixels`` become ``size.shortest_edge``/``size.longest_edge``, the form
    transformers 5 reads; anything else is refused by name.
    """
    size: dict[str, int] = {}
    for layer in layers:
        if not layer:
            continue
        unknown = sorted(set(layer) - set(SUPPORTED_PROCESSOR_KWARGS))
        if unknown:
            raise ValueError(f"mm_processor_kwargs: unsupported key(s) {unknown}; the Qwen-VL "
                             f"image processor takes {', '.join(SUPPORTED_PROCESSOR_KWARGS)}")
        given = layer.get("size") or {}
        if not isinstance(given, Mapping) or set(given) - {"shortest_edge", "longest_edge"}:
            raise ValueError("mm_processor_kwargs.size must be an object with 'shortest_edge' "
                             f"and/or 'longest_edge' (pixel counts), got {given!r}")
        size.update(given)
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if layer.get(key) is not None:
                size[edge] = layer[key]
    for edge, value in size.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mm_processor_kwargs: {edge} must be a positive number of pixels, "
                             f"got {value!r}")
    if size.get("shortest_edge", 0) > size.get("longest_edge", 1 << 62):
        raise ValueError(f"mm_processor_kwargs: min_pixels ({size['shortest_edge']}) is larger "
                         f"than max_pixels ({size['longest_edge']})")
    return {"size": size} if size else {}


class ImageProcessor:
    """The model's HF image processor plus what the engine needs around it: token counts before
    any pixel is touched, and per-image outputs with their content hashes."""

    def __init__(self, hf_processor: Any, defaults: Mapping[str, Any] | None = None) -> None:
        self.hf = hf_processor
        self.merge_size = int(hf_processor.merge_size)
        self.defaults = resolve_processor_kwargs(defaults)

    @classmethod
    def from_model_dir(cls, model_dir: str, vision_config: Any,
                       mm_processor_kwargs: Mapping[str, Any] | None = None) -> ImageProcessor:
        """Load ``preprocessor_config.json`` and check it against the tower's patch shapes."""
        if not os.path.isfile(os.path.join(model_dir, "preprocessor_config.json")):
            raise ValueError(f"{model_dir} has no preprocessor_config.json, which image inputs "
                             "need (copy it from the original checkpoint), or serve text only "
                             "with --limit-mm-per-prompt '{\"image\": 0}'")
        from transformers import AutoImageProcessor

        hf = AutoImageProcessor.from_pretrained(model_dir)
        for ours, theirs in (("patch_size", "patch_size"), ("spatial_merge_size", "merge_size"),
                             ("temporal_patch_size", "temporal_patch_size")):
            tower, proc = getattr(vision_config, ours), getattr(hf, theirs)
            if tower != proc:
                raise ValueError(f"preprocessor_config.json has {theirs}={proc} but the vision "
                                 f"tower's config.json has {ours}={tower}; they must agree")
        processor = cls(hf, mm_processor_kwargs)
        processor.kwargs()  # fail at start-up on settings the processor rejects
        return processor

    def kwargs(self, request_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The effective processor settings for a request (defaults, then its overrides)."""
        merged = resolve_processor_kwargs(self.defaults, request_kwargs)
        size = {**dict(self.hf.size), **merged.get("size", {})}
        if size["shortest_edge"] > size["longest_edge"]:
            raise ValueError(f"mm_processor_kwargs: min_pixels ({size['shortest_edge']}) is "
                             f"larger than max_pixels ({size['longest_edge']})")
        return {"size": size}

    def num_tokens(self, width: int, height: int,
                   request_kwargs: Mapping[str, Any] | None = None) -> int:
        """Tokens an image of ``width x height`` becomes, before it is processed (budgets)."""
        patches = self.hf.get_number_of_image_patches(height, width, self.kwargs(request_kwargs))
        return patches // (self.merge_size * self.merge_size)

    def process(self, images: Sequence[Image.Image],
                request_kwargs: Mapping[str, Any] | None = None,
                cache: LRUBytesCache[ProcessedImage] | None = None) -> list[ProcessedImage]:
        """Resize, normalize and patchify each image (RGB expected, see entrypoints/media);
        images already in ``cache`` under the same settings are not processed again."""
        kwargs = self.kwargs(request_kwargs)
        hashes = [image_content_hash(image) for image in images]
        keys = [processed_image_key(h, kwargs) for h in hashes]
        done = {k: v for k in keys if cache is not None and (v := cache.get(k)) is not None}
        todo = {k: i for i, k in enumerate(keys) if k not in done}  # first image of each key
        if todo:
            out = self.hf(images=[images[i] for i in todo.values()], return_tensors="pt",
                          **kwargs)
            grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()]
            pixels = out["pixel_values"].float().split([t * h * w for t, h, w in grids])
            for (key, i), p, grid in zip(todo.items(), pixels, grids):
                done[key] = ProcessedImage(p, grid, hashes[i])  # type: ignore[arg-type]
                if cache is not None:
                    cache.put(key, done[key])
        return [done[k] for k in keys]


def processed_nbytes(image: ProcessedImage) -> int:
    """What a processed image holds in the processed-image cache."""
    return image.pixel_values.numel() * image.pixel_values.element_size()
