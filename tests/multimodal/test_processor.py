"""Preprocessing through HF's image processor: token counts before processing, settings from
``--mm-processor-kwargs`` and per request, and start-up checks."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_vision import random_image, vision_config, write_preprocessor_config
from qwenserve.multimodal.processor import ImageProcessor, resolve_processor_kwargs

SIZES = [(37, 53), (64, 64), (300, 20), (8, 8), (1000, 700)]


@pytest.fixture()
def model_dir(tmp_path):
    return write_preprocessor_config(str(tmp_path))


def test_token_counts_before_processing_match_the_processed_grid(model_dir):
    processor = ImageProcessor.from_model_dir(model_dir, vision_config("qwen3_5"))
    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    for kwargs in (None, {"max_pixels": 32 * 32}, {"min_pixels": 48 * 48}):
        processed = processor.process(images, kwargs)
        for (w, h), image in zip(SIZES, processed):
            t, gh, gw = image.grid_thw
            assert image.pixel_values.shape == (t * gh * gw, 3 * 2 * 4 * 4)
            assert processor.num_tokens(w, h, kwargs) == t * gh * gw // 4
            pixels = gh * gw * 16
            size = processor.kwargs(kwargs)["size"]
            assert pixels <= size["longest_edge"] and pixels >= min(size["shortest_edge"], 64)


def test_each_image_is_processed_on_its_own(model_dir):
    """Batched processing gives each image what it gets alone (so outputs can be cached)."""
    processor = ImageProcessor.from_model_dir(model_dir, vision_config("qwen3_5"))
    images = [random_image(40, 24, seed=1), random_image(24, 72, seed=2)]
    together = processor.process(images)
    for image, alone in zip(together, [processor.process([i])[0] for i in images]):
        assert image.grid_thw == alone.grid_thw
        assert torch.equal(image.pixel_values, alone.pixel_values)
        assert image.content_hash == alone.content_hash
    assert together[0].content_hash != together[1].content_hash


def test_server_defaults_then_request_overrides(model_dir):
    processor = ImageProcessor.from_model_dir(model_dir, vision_config("qwen3_5"),
                                              {"max_pixels": 16 * 16})
    assert processor.num_tokens(256, 256) == 4  # 16 x 16 pixels: 2 x 2 merged tokens
    assert processor.num_tokens(256, 256, {"max_pixels": 32 * 32}) == 16
    assert processor.num_tokens(256, 256, {"size": {"longest_edge": 64 * 64}}) == 64
    assert processor.kwargs()["size"] == {"shortest_edge": 64, "longest_edge": 256}


@pytest.mark.parametrize("kwargs,message", [
    ({"max_pixel": 4}, r"unsupported key\(s\) \['max_pixel'\]"),
    ({"max_pixels": -3}, "longest_edge must be a positive number of pixels"),
    ({"min_pixels": "big"}, "shortest_edge must be a positive number"),
    ({"min_pixels": 900, "max_pixels": 100}, r"min_pixels \(900\) is larger than max_pixels"),
    ({"size": {"height": 3}}, "size must be an object with 'shortest_edge'"),
])
def test_bad_settings_are_refused_by_name(model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_processor_kwargs(kwargs)
    with pytest.raises(ValueError, match=message):
        ImageProcessor.from_model_dir(model_dir, vision_config("qwen3_5"), kwargs)


def test_request_min_above_server_max_is_refused(model_dir):
    processor = ImageProcessor.from_model_dir(model_dir, vision_config("qwen3_5"))
    with pytest.raises(ValueError, match=r"min_pixels \(8192\) is larger than max_pixels"):
        processor.num_tokens(100, 100, {"min_pixels": 8192})


def test_start_up_checks(tmp_path):
    with pytest.raises(ValueError, match="has no preprocessor_config.json"):
        ImageProcessor.from_model_dir(str(tmp_path), vision_config("qwen3_5"))
    write_preprocessor_config(str(tmp_path), patch_size=16)
    with pytest.raises(ValueError, match="patch_size=16 but the vision tower's config.json "
                                         "has patch_size=4"):
        ImageProcessor.from_model_dir(str(tmp_path), vision_config("qwen3_5"))


def test_without_torchvision_the_pil_processor_is_used(model_dir):
    """The checkpoints name the fast (torchvision) processor; transformers falls back to the PIL
    one here, and both implement the same smart resize."""
    processor = ImageProcessor.from_model_dir(model_dir, vision_config("qwen3_5"))
    try:
        import torchvision  # noqa: F401
    except ImportError:
        assert type(processor.hf).__name__ == "Qwen2VLImageProcessorPil"
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    for w, h in SIZES:
        rh, rw = smart_resize(h, w, 8, 64, 64 * 64)
        assert processor.num_tokens(w, h) == (rh // 8) * (rw // 8)
