"""Images of a request, turned into what the engine runs, before it reaches the engine thread:
the processor's pixels and grids, the prompt with each placeholder expanded, content hashes.

    token ids with one <|image_pad|> per image + PIL images
      -> HF image processor (cached across requests by content + settings)
      -> token ids with one <|image_pad|> per image token, MultiModalInputs (placements, pixels)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from qwenserve.multimodal.cache import LRUBytesCache
from qwenserve.multimodal.config import MultiModalConfig
from qwenserve.multimodal.inputs import MultiModalInputs
from qwenserve.multimodal.processor import ImageProcessor, ProcessedImage, processed_nbytes
from qwenserve.multimodal.prompt import ImagePromptFormat, expand_image_tokens

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


class ImageInputs:
    """The model's image processor, prompt format and processed-image cache."""

    def __init__(self, processor: ImageProcessor, prompt_format: ImagePromptFormat,
                 config: MultiModalConfig) -> None:
        self.processor = processor
        self.format = prompt_format
        self.config = config
        self.cache: LRUBytesCache[ProcessedImage] | None = (
            LRUBytesCache(config.processor_cache_bytes, processed_nbytes)
            if config.processor_cache_bytes else None)

    @classmethod
    def for_model(cls, model_dir: str, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase,
                  config: MultiModalConfig) -> ImageInputs:
        processor = ImageProcessor.from_model_dir(model_dir, hf_config.vision_config,
                                                  config.processor_kwargs)
        return cls(processor, ImagePromptFormat.from_config(hf_config, tokenizer), config)

    @classmethod
    def for_engine(cls, config: Any, tokenizer: PreTrainedTokenizerBase) -> ImageInputs | None:
        """The image front of an ``EngineConfig``'s model; None for text models,
        ``--language-model-only`` and ``--limit-mm-per-prompt '{"image": 0}'``."""
        mc, mm = config.model, config.multimodal
        if getattr(mc.hf_config, "vision_config", None) is None or mm.image_limit == 0:
            return None
        return cls.for_model(mc.source.folder, mc.hf_config, tokenizer, mm)

    @property
    def placeholder(self) -> str:
        """The text a chat renders for one image."""
        return self.format.placeholder

    def prepare(self, token_ids: Sequence[int], images: Sequence[Image.Image],
                processor_kwargs: Mapping[str, Any] | None = None
                ) -> tuple[list[int], MultiModalInputs]:
        """Process the images and expand the placeholders (counts must match; ValueError)."""
        processed = self.processor.process(images, processor_kwargs, self.cache)
        prompt = expand_image_tokens(token_ids, self.format.image_token_id,
                                     [p.grid_thw for p in processed],
                                     [p.content_hash for p in processed],
                                     self.processor.merge_size)
        return prompt.token_ids, MultiModalInputs(prompt.placements,
                                                  prompt.mrope_position_delta, processed)
