"""The processed-image cache: LRU within a byte budget, and the processor skipping cached work."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_vision import random_image, vision_config, write_preprocessor_config
from qwenserve.multimodal.cache import LRUBytesCache
from qwenserve.multimodal.processor import ImageProcessor, processed_nbytes


def test_lru_within_the_byte_budget():
    cache = LRUBytesCache(10, size_of=len)
    assert cache.put("a", "xxxx") and cache.put("b", "yyyy")
    assert cache.get("a") == "xxxx"  # a is now the most recent
    assert cache.put("c", "zzzz")  # 12 bytes > 10: b (least recent) goes
    assert cache.get("b") is None and cache.get("a") == "xxxx" and cache.get("c") == "zzzz"
    assert cache.used_bytes == 8 and len(cache) == 2
    assert not cache.put("big", "x" * 11) and cache.get("big") is None  # never fits
    assert cache.put("a", "x") and cache.used_bytes == 5  # replacing frees the old size
    assert (cache.queries, cache.hits) == (5, 3)
    assert LRUBytesCache(0, size_of=len).put("a", "")  # a 0-byte budget holds only empty items
    with pytest.raises(ValueError, match="must be >= 0"):
        LRUBytesCache(-1, size_of=len)


class CountingProcessor:
    """HF's processor, counting the images it is asked to process."""

    def __init__(self, hf):
        self.hf, self.images = hf, 0

    def __call__(self, images, **kwargs):
        self.images += len(images)
        return self.hf(images=images, **kwargs)

    def __getattr__(self, name):
        return getattr(self.hf, name)


def test_processor_reuses_cached_images(tmp_path):
    processor = ImageProcessor.from_model_dir(write_preprocessor_config(str(tmp_path)),
                                              vision_config("qwen3_5"))
    counting = processor.hf = CountingProcessor(processor.hf)
    cache = LRUBytesCache(1 << 20, processed_nbytes)
    a, b = random_image(40, 24, seed=1), random_image(24, 40, seed=2)
    first = processor.process([a, b, a], cache=cache)  # the repeat is processed once
    assert counting.images == 2 and len(cache) == 2
    assert torch.equal(first[0].pixel_values, first[2].pixel_values)
    again = processor.process([b, a], cache=cache)
    assert counting.images == 2 and cache.hits == 2
    assert [x.content_hash for x in again] == [first[1].content_hash, first[0].content_hash]
    processor.process([a], {"max_pixels": 16 * 16}, cache=cache)  # other settings: a miss
    assert counting.images == 3 and len(cache) == 3
    uncached = processor.process([a, b])
    assert counting.images == 5
    assert all(torch.equal(x.pixel_values, y.pixel_values) for x, y in zip(uncached, first))
