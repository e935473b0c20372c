"""Images through the server with the ``openai`` client: data URLs, local files with and without
``--allowed-local-media-path``, ``--limit-mm-per-prompt``, and each bad-image case as a 400
that names the problem. A tiny random Qwen3.5 vision-language checkpoint on 127.0.0.1."""

from __future__ import annotations

import base64
import io
import json

import openai
import pytest
from oai_server import RemoteServer

from helpers.tiny_vision import make_tiny_vl_checkpoint, random_image

MAX_TOKENS = 5


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    random_image(40, 24, seed=1).save(allowed / "a.png")
    random_image(40, 24, seed=1).save(outside / "a.png")
    (allowed / "not_an_image.png").write_bytes(b"hello, I am text")
    random_image(64, 64, seed=5).save(allowed / "big.png")
    return allowed, outside


@pytest.fixture(scope="module")
def vl_server(media, tmp_path_factory):
    path = make_tiny_vl_checkpoint("qwen3_5", str(tmp_path_factory.mktemp("vl") / "qwen3_5"))
    log = tmp_path_factory.mktemp("vl_server") / "serve.log"
    srv = RemoteServer([path, "--dtype", "float32", "--max-model-len", "256",
                        "--kv-cache-memory-bytes", "32M", "--allowed-local-media-path",
                        str(media[0]), "--limit-mm-per-prompt", json.dumps({"image": 2}),
                        "--mm-processor-cache-gb", "0.01", "--disable-uvicorn-access-log"],
                       log, env={"VLLM_MAX_IMAGE_PIXELS": "3000"})
    yield srv
    srv.stop()


def chat(srv, *parts, **kw):
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    with srv.client() as client:
        return client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=MAX_TOKENS, temperature=0,
            messages=[{"role": "user", "content": content}], **kw)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_data_url_and_allowed_file_give_the_same_answer(vl_server, media):
    image = random_image(40, 24, seed=1)
    by_data = chat(vl_server, "What is", image_part(data_url(image)))
    by_file = chat(vl_server, "What is", image_part((media[0] / "a.png").as_uri()))
    smaller = chat(vl_server, "What is", image_part(data_url(random_image(16, 16, seed=1))))
    # 40 x 24 pixels -> 10 x 6 patches -> 5 x 3 = 15 image tokens; 16 x 16 -> 2 x 2 = 4
    assert by_data.usage.prompt_tokens == smaller.usage.prompt_tokens + 15 - 4
    assert by_data.choices[0].message.content == by_file.choices[0].message.content
    other = chat(vl_server, "What is", image_part(data_url(random_image(40, 24, seed=8))))
    assert other.usage.prompt_tokens == by_data.usage.prompt_tokens
    # a JPEG of the same picture decodes to other pixels; streaming works with images too
    with vl_server.client() as client:
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=MAX_TOKENS, temperature=0,
            stream=True, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is"}, image_part(data_url(image))]}])
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == by_data.choices[0].message.content


def bad_request(srv, *parts, **kw) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        chat(srv, *parts, **kw)
    return str(e.value)


def mm_cache_counters(srv) -> tuple[float, float]:
    import httpx

    text = httpx.get(srv.base_url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in ("vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total"):
            values[name] = float(line.rsplit(" ", 1)[1])
    return values["vllm:mm_cache_queries_total"], values["vllm:mm_cache_hits_total"]


def test_mm_cache_metrics_count_images_and_hits(vl_server):
    """/metrics: ``vllm:mm_cache_queries`` counts every image looked up in the processed-image
    cache (``--mm-processor-cache-gb``), ``vllm:mm_cache_hits`` those found there."""
    queries, hits = mm_cache_counters(vl_server)
    new, again = random_image(32, 32, seed=11), random_image(32, 32, seed=12)
    chat(vl_server, "Compare", image_part(data_url(new)), image_part(data_url(again)))
    chat(vl_server, "Again", image_part(data_url(again)))  # processed already: a hit
    assert mm_cache_counters(vl_server) == (queries + 3, hits + 1)


def test_file_outside_the_allowed_path_is_refused(vl_server, media):
    message = bad_request(vl_server, "x", image_part((media[1] / "a.png").as_uri()))
    assert "messages.0.content.1" in message and "allowed-local-media-path" in message


def test_image_limit(vl_server):
    url = data_url(random_image(16, 16, seed=2))
    assert chat(vl_server, image_part(url), image_part(url)).choices
    message = bad_request(vl_server, image_part(url), image_part(url), image_part(url))
    assert "At most 2 image(s)" in message and "--limit-mm-per-prompt" in message


@pytest.mark.parametrize("case,part,expected", [
    ("not an image", "data:image/png;base64," + base64.b64encode(b"plain text").decode(),
     "not an image"),
    ("undecodable data URL", "data:image/png;base64,@@@not-base64@@@", "base64"),
    ("too many pixels", "big", "pixels"),
    ("a text file named .png", "text_file", "not an image"),
    ("http without allowed domains", "http://127.0.0.1:9/x.png", "allowed-media-domains"),
])
def test_bad_images_are_400_naming_the_problem(vl_server, media, case, part, expected):
    if part == "big":
        part = data_url(random_image(64, 64, seed=5))
    elif part == "text_file":
        part = (media[0] / "not_an_image.png").as_uri()
    message = bad_request(vl_server, "x", image_part(part))
    assert "messages.0.content.1" in message, case
    assert expected in message.lower() or expected in message, (case, message)


def test_video_parts_and_bad_processor_kwargs_are_refused(vl_server):
    message = bad_request(vl_server, "x", {"type": "video_url", "video_url": {"url": "x"}})
    assert "video" in message
    url = data_url(random_image(16, 16, seed=2))
    message = bad_request(vl_server, image_part(url),
                          extra_body={"mm_processor_kwargs": {"fps": 2}})
    assert "mm_processor_kwargs" in message
    # a smaller max_pixels gives fewer image tokens
    small = chat(vl_server, image_part(data_url(random_image(64, 40, seed=3))),
                 extra_body={"mm_processor_kwargs": {"max_pixels": 1024}})
    full = chat(vl_server, image_part(data_url(random_image(64, 40, seed=3))))
    assert small.usage.prompt_tokens < full.usage.prompt_tokens


def test_a_text_model_refuses_images(server):
    with server.client() as client:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=client.models.list().data[0].id, max_tokens=2, messages=[
                    {"role": "user", "content": [image_part(data_url(random_image(8, 8)))]}])
    assert "text-only" in str(e.value) and "messages.0.content.0" in str(e.value)
