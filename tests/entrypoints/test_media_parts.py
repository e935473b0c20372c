"""Chat content parts and the offline ``multi_modal_data`` -> placeholders and ordered images."""

from __future__ import annotations

import base64
import io

import pytest

from helpers.tiny_models import build_tokenizer
from helpers.tiny_vision import random_image
from qwenserve.entrypoints.chat_utils import normalize_messages, render_chat
from qwenserve.entrypoints.media import MediaConfig, MediaConnector, MediaError
from qwenserve.entrypoints.media_parts import (
    DEFAULT_IMAGE_LIMIT,
    extract_chat_images,
    load_images,
    parse_limit_mm_per_prompt,
    parse_multi_modal_data,
)

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def url_of(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


A, B, C = (random_image(16, 8 + 8 * i, seed=i) for i in range(3))


def conversation():
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url_of(A)}},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": url_of(B)}},
            {"type": "text", "text": "differ how?"},
        ]},
        {"role": "assistant", "content": "In size."},
        {"role": "user", "content": [{"type": "text", "text": "This one?"},
                                     {"type": "image_pil", "image_pil": C}]},
    ]


def test_placeholders_in_place_and_images_in_order():
    parsed = extract_chat_images(conversation(), PLACEHOLDER, image_limit=3)
    assert [s.param for s in parsed.images] == [
        "messages.1.content.0", "messages.1.content.2", "messages.3.content.1"]
    text = render_chat(build_tokenizer(), normalize_messages(parsed.messages))
    assert f"user\n{PLACEHOLDER}\nand\n{PLACEHOLDER}\ndiffer how?<|im_end|>" in text
    assert f"This one?\n{PLACEHOLDER}<|im_end|>" in text
    assert text.count(PLACEHOLDER) == 3
    loaded = load_images(parsed.images, MediaConnector(MediaConfig()))
    assert [im.tobytes() for im in loaded] == [A.tobytes(), B.tobytes(), C.tobytes()]


def test_openai_content_format_keeps_image_parts():
    parsed = extract_chat_images(conversation(), PLACEHOLDER, 3, content_format="openai")
    assert parsed.messages[1]["content"][0] == {"type": "image"}
    assert parsed.messages[1]["content"][1] == {"type": "text", "text": "and"}


def test_image_limit():
    with pytest.raises(MediaError, match=r"At most 2 image\(s\) may be provided in one prompt; "
                                         r"this one has 3.*'\{\"image\": 3\}'"):
        extract_chat_images(conversation(), PLACEHOLDER, image_limit=2)
    with pytest.raises(MediaError, match="image inputs are disabled on this server"):
        extract_chat_images(conversation(), PLACEHOLDER, image_limit=0)
    text_only = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert extract_chat_images(text_only, PLACEHOLDER, image_limit=0).images == []


@pytest.mark.parametrize("part,message", [
    ({"type": "video_url", "video_url": {"url": "x"}}, "video inputs are not supported"),
    ({"type": "input_audio", "input_audio": {}}, "audio inputs are not supported"),
    ({"type": "image_embeds", "image_embeds": "x"}, "embeddings are not supported"),
    ({"type": "image_url", "image_url": {}}, 'needs "image_url": {"url": "..."}'),
    ({"type": "image_url", "image_url": 5}, 'needs "image_url": {"url": "..."}'),
    ({"type": "image_pil", "image_pil": "a.png"}, "needs a PIL.Image, got str"),
])
def test_unusable_parts_are_named(part, message):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    with pytest.raises(MediaError, match=message) as info:
        extract_chat_images(messages, PLACEHOLDER, 5)
    assert info.value.param == "messages.0.content.1"


def test_a_bad_image_names_its_part():
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url_of(A)}},
        {"type": "input_image", "image_url": "data:image/png;base64,bm90IGFuIGltYWdl"}]}]
    parsed = extract_chat_images(messages, PLACEHOLDER, 5)
    with pytest.raises(MediaError, match="messages.0.content.1: the data is not an image") as e:
        load_images(parsed.images, MediaConnector(MediaConfig()))
    assert e.value.param == "messages.0.content.1"


def test_concurrent_loading_keeps_the_order():
    parsed = extract_chat_images(conversation() * 2, PLACEHOLDER, 6)  # 4 URLs, 2 PIL images
    loaded = load_images(parsed.images, MediaConnector(MediaConfig()))
    assert [im.size for im in loaded] == [A.size, B.size, C.size] * 2


def test_offline_multi_modal_data():
    assert [s.image.tobytes() for s in parse_multi_modal_data({"image": A}, 4)] == [A.tobytes()]
    two = parse_multi_modal_data({"image": [A, B]}, 4)
    assert [s.param for s in two] == ["multi_modal_data.image.0", "multi_modal_data.image.1"]
    rgba = A.convert("RGBA")
    assert parse_multi_modal_data({"image": rgba}, 4)[0].image.mode == "RGB"
    for data, message in [
        ({"video": [A]}, "video inputs are not supported"),
        ({"audio": 1}, "audio inputs are not supported"),
        ({"image": "a.png"}, r"\['image'\]\[0\]: an image_pil part needs a PIL.Image, got str"),
        ([A], "must be a dict"),
        ({"image": [A, B, C]}, r"At most 2 image\(s\)"),
    ]:
        with pytest.raises(MediaError, match=message):
            parse_multi_modal_data(data, 2)


def test_limit_mm_per_prompt_forms():
    assert parse_limit_mm_per_prompt(None) == DEFAULT_IMAGE_LIMIT == 999
    assert parse_limit_mm_per_prompt('{"image": 4}') == 4
    assert parse_limit_mm_per_prompt({"image": {"count": 2, "width": 512, "height": 512}}) == 2
    assert parse_limit_mm_per_prompt('{"image": 0, "video": 0}') == 0
    assert parse_limit_mm_per_prompt('{"video": 0}') == 999
    for value, message in [
        ("{image: 4}", "not valid JSON"),
        ('{"image": -1}', "'image' needs a count >= 0"),
        ('{"image": true}', "'image' needs a count >= 0"),
        ('{"video": 1}', "video inputs are not supported"),
        ("[4]", "must be a JSON object"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_limit_mm_per_prompt(value)
