"""Content hashes of images: prefix-cache keys and the processed-image cache key.

The hash covers the decoded pixels (mode, size, raw bytes), not the file: the same picture sent
as PNG and as a data URL of the same PNG hashes the same, and two files that decode to different
pixels never collide. blake2b for the same reason as the prefix-cache keys (core/cache/hashing):
a collision would silently reuse another image's KV.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image


def image_content_hash(image: Image.Image) -> str:
    """Hex digest of the image's pixels, mode and size."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    if image.mode == "P" and image.palette is not None:
        h.update(bytes(image.palette.tobytes()))
    h.update(image.tobytes())
    return h.hexdigest()


def processed_image_key(content_hash: str, processor_kwargs: Mapping[str, object]) -> str:
    """Key of one image's processor output: the same pixels resized under other min/max pixels
    give other patches, so the effective processor settings are part of the key."""
    settings = json.dumps(dict(processor_kwargs), sort_keys=True, default=str)
    return hashlib.blake2b(f"{content_hash}|{settings}".encode(), digest_size=16).hexdigest()
