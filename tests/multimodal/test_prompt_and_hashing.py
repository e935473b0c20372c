"""Placeholder expansion, image placements in prefix-cache keys, and image content hashes."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from helpers.tiny_models import build_tokenizer
from helpers.tiny_vision import random_image
from qwenserve.multimodal.hashing import image_content_hash, processed_image_key
from qwenserve.multimodal.inputs import ImagePlacement, block_extra_key, num_image_tokens
from qwenserve.multimodal.prompt import ImagePromptFormat, expand_image_tokens

PAD = 9


def test_each_placeholder_becomes_the_images_tokens():
    ids = [1, 7, PAD, 8, 2, 3, 7, PAD, 8, 4]
    prompt = expand_image_tokens(ids, PAD, [(1, 4, 6), (1, 2, 2)], ["a", "b"], 2)
    assert prompt.token_ids == [1, 7] + [PAD] * 6 + [8, 2, 3, 7, PAD, 8, 4]
    first, second = prompt.placements
    assert (first.offset, first.num_tokens, first.content_hash) == (2, 6, "a")
    assert (second.offset, second.num_tokens, second.llm_grid_thw) == (12, 1, (1, 1, 1))
    assert prompt.mrope_position_delta == (6 - 3) * -1  # a 2 x 3 image advances 3, not 6


@pytest.mark.parametrize("grids", [[], [(1, 2, 2)] * 3])
def test_placeholder_count_must_match_the_images(grids):
    with pytest.raises(ValueError, match=f"2 image placeholder\\(s\\) but {len(grids)} image"):
        expand_image_tokens([PAD, 5, PAD], PAD, grids, ["h"] * len(grids), 2)


def test_grid_must_divide_by_the_merge_size():
    with pytest.raises(ValueError, match=r"patch grid \(1, 3, 4\) is not divisible"):
        num_image_tokens((1, 3, 4), 2)


def test_prompt_format_from_the_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]})
    start, end, pad = tokenizer.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
    config = type("C", (), {"image_token_id": pad, "vision_start_token_id": start,
                            "vision_end_token_id": end})()
    fmt = ImagePromptFormat.from_config(config, tokenizer)
    assert fmt.placeholder == "<|vision_start|><|image_pad|><|vision_end|>"
    assert tokenizer.encode("a" + fmt.placeholder, add_special_tokens=False)[-3:] == [start, pad,
                                                                                      end]


def test_blocks_holding_image_tokens_key_on_the_images():
    a = ImagePlacement(5, (1, 4, 4), 2, "aaaa")  # tokens 5..8
    b = ImagePlacement(20, (1, 4, 4), 2, "bbbb")  # tokens 20..23
    assert block_extra_key([a, b], 0, 4) == b""
    assert block_extra_key([a, b], 0, 16) == b"5:aaaa"
    assert block_extra_key([a, b], 8, 24) == b"5:aaaa;20:bbbb"
    assert block_extra_key([a, b], 9, 20) == b""
    swapped = [ImagePlacement(5, (1, 4, 4), 2, "bbbb"), ImagePlacement(20, (1, 4, 4), 2, "aaaa")]
    assert block_extra_key(swapped, 0, 32) != block_extra_key([a, b], 0, 32)


def _reencoded(image: Image.Image, fmt: str) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return Image.open(io.BytesIO(buffer.getvalue()))


def test_content_hash_follows_the_pixels_not_the_file():
    image = random_image(31, 17, seed=3)
    digest = image_content_hash(image)
    assert image_content_hash(_reencoded(image, "PNG")) == digest
    assert image_content_hash(_reencoded(image, "BMP")) == digest
    changed = image.copy()
    changed.putpixel((30, 16), (0, 0, 0) if image.getpixel((30, 16)) != (0, 0, 0) else (1, 1, 1))
    assert image_content_hash(changed) != digest
    assert image_content_hash(image.convert("L")) != image_content_hash(image.convert("L")
                                                                        .convert("RGB"))
    transposed = image.transpose(Image.Transpose.TRANSPOSE)  # same bytes count, other shape
    assert image_content_hash(transposed) != digest


def test_processed_key_includes_the_processor_settings():
    small = processed_image_key("abc", {"size": {"longest_edge": 100}})
    assert small == processed_image_key("abc", {"size": {"longest_edge": 100}})
    assert small != processed_image_key("abc", {"size": {"longest_edge": 200}})
    assert small != processed_image_key("abd", {"size": {"longest_edge": 100}})


def test_chunks_cut_through_images():
    from qwenserve.multimodal.inputs import ImageSlice, image_slices

    images = [ImagePlacement(2, (1, 4, 6), 2, "a"), ImagePlacement(9, (1, 4, 4), 2, "b")]
    assert image_slices(images, 4, 12) == [ImageSlice(0, 0, 2, 6), ImageSlice(1, 5, 0, 3)]
    assert image_slices(images, 0, 2) == [] and image_slices(images, 8, 9) == []
    # every image token lands in exactly one chunk, whatever the chunk size
    for size in (1, 3, 5, 14):
        covered = [(s.image_index, t) for start in range(0, 14, size)
                   for s in image_slices(images, start, min(start + size, 14))
                   for t in range(s.token_start, s.token_end)]
        assert covered == [(0, t) for t in range(6)] + [(1, t) for t in range(4)]


def test_placements_import_no_torch():
    """The scheduler (no torch, see test_architecture) will keep placements with requests."""
    import subprocess
    import sys

    code = ("import sys, qwenserve.multimodal.inputs; "
            "assert 'torch' not in sys.modules and 'PIL' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
