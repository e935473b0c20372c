"""Images in requests: chat content parts and the offline ``multi_modal_data``, parsed into the
prompt's placeholders and an ordered list of images.

    [{"type": "text", "text": "What is"},              [{"type": "text", "text": "What is"},
     {"type": "image_url", "image_url": {"url": U}}] ->  {"type": "text", "text": PLACEHOLDER}]
                                                        + images [ImageSource(U, ...)]

PLACEHOLDER is the model's ``<|vision_start|><|image_pad|><|vision_end|>``; with the
``openai`` content format the part becomes ``{"type": "image"}``, which Qwen-VL chat templates
render as that same text. Images keep the order of their parts across messages, which is the
order of the placeholders in the rendered prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qwenserve.entrypoints.media import MediaConnector, MediaError, to_rgb
from qwenserve.multimodal.config import (  # noqa: F401 (re-exported)
    DEFAULT_IMAGE_LIMIT,
    parse_limit_mm_per_prompt,
)

if TYPE_CHECKING:
    from PIL import Image

_TEXT_PARTS = ("text", "input_text")
_REFUSED_PARTS = {
    "video_url": "video inputs are not supported; send video frames as image_url parts",
    "input_video": "video inputs are not supported; send video frames as image_url parts",
    "audio_url": "audio inputs are not supported: the served models take text and images",
    "input_audio": "audio inputs are not supported: the served models take text and images",
    "image_embeds": "precomputed image embeddings are not supported; send the image itself",
}


@dataclass(frozen=True)
class ImageSource:
    """One image of a request, before loading: a URL, or a PIL image given offline."""

    param: str  # where it was in the request, e.g. "messages.0.content.1"
    url: str | None = None
    image: Image.Image | None = None


@dataclass(frozen=True)
class ChatImages:
    messages: list[dict]  # image parts replaced by placeholders
    images: list[ImageSource]


def check_image_count(count: int, limit: int, param: str = "messages") -> None:
    if count > limit:
        hint = " (image inputs are disabled on this server)" if limit == 0 else ""
        raise MediaError(f"At most {limit} image(s) may be provided in one prompt; this one has "
                         f"{count}{hint}. Raise it with --limit-mm-per-prompt "
                         f"'{{\"image\": {count}}}'.", param)


def extract_chat_images(messages: Sequence[dict], placeholder: str, image_limit: int,
                        content_format: str = "string") -> ChatImages:
    """Replace each image part by the model's placeholder and collect the images in order."""
    images: list[ImageSource] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            parts = [_part(f"messages.{i}.content.{j}", part, placeholder, content_format,
                           images) for j, part in enumerate(content)]
            message = {**message, "content": parts}
        out.append(message)
    check_image_count(len(images), image_limit)
    return ChatImages(out, images)


def _part(param: str, part: Any, placeholder: str, content_format: str,
          images: list[ImageSource]) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _REFUSED_PARTS:
        raise MediaError(f"{param}: {_REFUSED_PARTS[kind]}", param)
    if kind == "image_pil":
        images.append(ImageSource(param, image=_pil_image(param, part.get("image_pil"))))
    elif kind in ("image_url", "input_image"):
        images.append(ImageSource(param, url=_url_of(param, part.get("image_url"))))
    else:
        return part  # text, or a type the chat normalizer names in its own error
    if content_format == "openai":
        return {"type": "image"}
    return {"type": "text", "text": placeholder}


def _url_of(param: str, value: Any) -> str:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise MediaError(f'{param}: an image_url part needs "image_url": {{"url": "..."}} with '
                         "a data:, http(s) or file:// URL", param)
    return url


def _pil_image(param: str, value: Any) -> Image.Image:
    from PIL import Image

    if not isinstance(value, Image.Image):
        raise MediaError(f"{param}: an image_pil part needs a PIL.Image, got "
                         f"{type(value).__name__}", param)
    return to_rgb(value)


def parse_multi_modal_data(data: Any, image_limit: int,
                           param: str = "multi_modal_data") -> list[ImageSource]:
    """The offline ``{"prompt": ..., "multi_modal_data": {"image": img or [img, ...]}}``."""
    if not isinstance(data, Mapping):
        raise MediaError(f"{param} must be a dict such as {{'image': PIL.Image}}", param)
    for key in data:
        if key != "image":
            reason = _REFUSED_PARTS.get(f"{key}_url", "only 'image' is supported")
            raise MediaError(f"{param}[{key!r}]: {reason}", param)
    value = data.get("image")
    items = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    check_image_count(len(items), image_limit, param)
    return [ImageSource(f"{param}.image.{i}", image=_pil_image(f"{param}['image'][{i}]", item))
            for i, item in enumerate(items)]


def load_images(sources: Sequence[ImageSource], connector: MediaConnector) -> list[Image.Image]:
    """Load every image, the URLs concurrently (``MediaConnector.load_images``); a failure
    names the part it came from (the first failing part, in prompt order)."""
    remote = [s for s in sources if s.image is None]
    loaded = dict(zip((id(s) for s in remote),
                      connector.load_images([s.url or "" for s in remote])))
    images = []
    for source in sources:
        image = source.image if source.image is not None else loaded[id(source)]
        if isinstance(image, MediaError):
            raise MediaError(f"{source.param}: {image}", source.param) from image
        images.append(image)
    return images
