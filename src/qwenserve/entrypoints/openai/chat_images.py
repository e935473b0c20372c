"""Images of a chat request on the server: image parts become the model's placeholders before
the template renders, then the images are fetched, decoded and processed, and the placeholders
expanded (all on the server's CPU pool, with the rest of ``prepare_chat``, never on the event
loop). Every failure is a 400 that names the content part (``messages.0.content.1: the data is
not an image ...``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qwenserve.config import EngineConfig
from qwenserve.engine.request_checks import images_refused_reason
from qwenserve.entrypoints.chat_utils import ChatMessageError
from qwenserve.entrypoints.media import MediaConfig, MediaConnector
from qwenserve.entrypoints.media_parts import (
    ChatImages,
    ImageSource,
    extract_chat_images,
    load_images,
)
from qwenserve.entrypoints.openai.errors import bad_request
from qwenserve.metrics.stats import MultiModalCacheStats
from qwenserve.multimodal.config import MultiModalConfig
from qwenserve.multimodal.front import ImageInputs
from qwenserve.multimodal.inputs import MultiModalInputs


class ServerImages:
    """The server's image front: placeholders, limits, where images may come from."""

    def __init__(self, engine: Any) -> None:
        """From the engine's config and tokenizer: the front runs in the API process, whether
        the engine core runs in a thread or in its own process."""
        config = getattr(engine, "config", None)
        if isinstance(config, EngineConfig):
            mm = config.multimodal
            self.front = ImageInputs.for_engine(config, engine.get_tokenizer())
            self.refused_reason = images_refused_reason(config)
        else:  # a stand-in engine without a model config (tests)
            mm, self.front = MultiModalConfig(), None
            self.refused_reason = "this server does not take image inputs"
        self.limit = mm.image_limit
        self.connector = MediaConnector(MediaConfig(mm.allowed_local_media_path,
                                                    mm.allowed_media_domains))

    def cache_stats(self) -> MultiModalCacheStats:
        """Queries and hits of the processed-image cache so far (``vllm:mm_cache_*``); zeros
        without one (a text model, ``--mm-processor-cache-gb 0``)."""
        cache = self.front.cache if self.front is not None else None
        if cache is None:
            return MultiModalCacheStats()
        return MultiModalCacheStats(cache.queries, cache.hits)

    def extract(self, messages: list[dict], content_format: str) -> ChatImages:
        """Image parts -> placeholders (the chat's images in order); a text-only server refuses
        them, naming the part."""
        placeholder = self.front.placeholder if self.front is not None else ""
        chat = extract_chat_images(messages, placeholder, self.limit, content_format)
        if chat.images and self.front is None:
            raise ChatMessageError(f"{chat.images[0].param}: {self.refused_reason}",
                                   chat.images[0].param)
        return chat

    def expand(self, sources: list[ImageSource], token_ids: list[int],
               processor_kwargs: Mapping[str, Any] | None
               ) -> tuple[list[int], MultiModalInputs | None]:
        """Load and process the images, expand their placeholders (blocking)."""
        if not sources:
            return token_ids, None
        assert self.front is not None
        try:
            images = load_images(sources, self.connector)
            return self.front.prepare(token_ids, images, processor_kwargs)
        except ChatMessageError as e:
            raise bad_request(str(e), e.param) from e
        except ValueError as e:
            param = "mm_processor_kwargs" if "mm_processor_kwargs" in str(e) else "messages"
            raise bad_request(str(e), param) from e
