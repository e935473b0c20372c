"""Loading images from data:, file:// and http(s) URLs, with each refusal naming its fix.

http(s) runs against a real HTTP server on 127.0.0.1 (loopback only)."""

from __future__ import annotations

import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from helpers.tiny_vision import random_image
from qwenserve.entrypoints.media import MediaConfig, MediaConnector, MediaError, decode_image


def png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


IMAGE = random_image(20, 12, seed=1)
PNG = png_bytes(IMAGE)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


class InFlight:
    """How many ``/held`` requests the server is answering at once (and the most so far)."""

    lock = threading.Lock()
    now = peak = 0

    @classmethod
    def reset(cls) -> None:
        with cls.lock:
            cls.now = cls.peak = 0

    @classmethod
    def enter(cls) -> None:
        with cls.lock:
            cls.now += 1
            cls.peak = max(cls.peak, cls.now)

    @classmethod
    def leave(cls) -> None:
        with cls.lock:
            cls.now -= 1


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        try:
            if self.path.startswith("/held"):  # answered after 1 s, counted while held
                InFlight.enter()
                try:
                    time.sleep(1.0)
                finally:
                    InFlight.leave()
            self._respond()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up first (the timeout and size-cap cases)

    def _respond(self) -> None:
        port = self.server.server_address[1]
        routes = {
            "/img.png": (200, {}, PNG),
            "/missing": (404, {}, b"no"),
            "/text": (200, {}, b"hello, not an image"),
            "/same-host-redirect": (302, {"Location": "/img.png"}, b""),
            "/redirect-away": (302, {"Location": f"http://localhost:{port}/img.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
        }
        if self.path == "/slow":
            time.sleep(1.5)
        if self.path == "/endless":  # no Content-Length, more bytes than the limit
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"\0" * 300_000)
            return
        status, headers, body = routes.get(self.path, (200, {}, PNG))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def http_base():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def connector(**kwargs) -> MediaConnector:
    return MediaConnector(MediaConfig(**kwargs))


def same_pixels(a: Image.Image, b: Image.Image) -> bool:
    return a.mode == b.mode and a.size == b.size and a.tobytes() == b.tobytes()


def test_data_urls():
    assert same_pixels(connector().load_image(data_url(PNG)), IMAGE)
    assert same_pixels(connector().load_image(data_url(png_bytes(IMAGE, "BMP"), "image/bmp")),
                       IMAGE)
    for url, message in [
        ("data:image/png;base64,%%%notbase64", "base64 data cannot be decoded"),
        ("data:image/png,rawbytes", "only base64 data URLs are supported"),
        ("data:image/png;base64", "has no ','"),
        (data_url(b"plain text, not a picture"), "not an image in a supported format"),
        (data_url(PNG[: len(PNG) // 2]), "truncated or corrupt"),
        ("ftp://host/x.png", "scheme 'ftp' is not supported"),
    ]:
        with pytest.raises(MediaError, match=message):
            connector().load_image(url)


def test_size_and_pixel_limits():
    with pytest.raises(MediaError, match="holds more than 100 bytes"):
        connector(max_download_bytes=100).load_image(data_url(PNG))
    with pytest.raises(MediaError, match=r"20x12 = 240 pixels, more than the limit of 239"):
        connector(max_image_pixels=239).load_image(data_url(PNG))


def test_rgba_and_grey_become_rgb():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent: white
    out = decode_image(png_bytes(rgba), 10**6)
    assert out.mode == "RGB" and out.getpixel((0, 0)) == (255, 255, 255)
    grey = decode_image(png_bytes(Image.new("L", (3, 3), 7)), 10**6)
    assert grey.mode == "RGB" and grey.getpixel((1, 1)) == (7, 7, 7)


def test_local_files_only_under_the_allowed_path(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    url = f"file://{allowed / 'a.png'}"
    with pytest.raises(MediaError, match="without `--allowed-local-media-path`"):
        connector().load_image(url)
    media = connector(allowed_local_media_path=str(allowed))
    assert same_pixels(media.load_image(url), IMAGE)
    for bad in (f"file://{tmp_path / 'secret.png'}", f"file://{allowed}/../secret.png",
                f"file://{allowed / 'link.png'}"):
        with pytest.raises(MediaError, match="is not under --allowed-local-media-path"):
            media.load_image(bad)
    with pytest.raises(MediaError, match="no such file"):
        media.load_image(f"file://{allowed / 'nope.png'}")
    with pytest.raises(ValueError, match="no such directory"):
        MediaConfig(allowed_local_media_path=str(tmp_path / "absent"))


def test_http_only_from_allowed_hosts(http_base):
    with pytest.raises(MediaError, match="http\\(s\\) URLs is disabled; start the server with "
                                         "--allowed-media-domains 127.0.0.1"):
        connector().load_image(f"{http_base}/img.png")
    with pytest.raises(MediaError, match="host '127.0.0.1' is not in --allowed-media-domains"):
        connector(allowed_media_domains=("example.com",)).load_image(f"{http_base}/img.png")
    web = connector(allowed_media_domains=("127.0.0.1",))
    assert same_pixels(web.load_image(f"{http_base}/img.png"), IMAGE)
    assert same_pixels(web.load_image(f"{http_base}/same-host-redirect"), IMAGE)
    with pytest.raises(MediaError, match="host 'localhost' is not in --allowed-media-domains"):
        web.load_image(f"{http_base}/redirect-away")
    with pytest.raises(MediaError, match="redirected more than 5 times"):
        web.load_image(f"{http_base}/loop")
    with pytest.raises(MediaError, match="failed: HTTP 404"):
        web.load_image(f"{http_base}/missing")
    with pytest.raises(MediaError, match="not an image"):
        web.load_image(f"{http_base}/text")


def test_http_size_cap_and_timeout(http_base):
    small = connector(allowed_media_domains=("127.0.0.1",), max_download_bytes=len(PNG) - 1)
    with pytest.raises(MediaError, match=f"larger than {len(PNG) - 1} bytes"):
        small.load_image(f"{http_base}/img.png")  # refused from its Content-Length
    capped = connector(allowed_media_domains=("127.0.0.1",), max_download_bytes=100_000)
    with pytest.raises(MediaError, match="larger than 100000 bytes"):
        capped.load_image(f"{http_base}/endless")  # cut while streaming
    quick = connector(allowed_media_domains=("127.0.0.1",), fetch_timeout_s=0.3)
    with pytest.raises(MediaError, match="timed out after 0.3 s"):
        quick.load_image(f"{http_base}/slow")


def test_several_urls_are_fetched_concurrently(http_base):
    """A request's URLs are fetched at once (the server holds all four together), and so are
    those of concurrent requests through one connector; each keeps its own order."""
    web = connector(allowed_media_domains=("127.0.0.1",))
    InFlight.reset()
    start = time.monotonic()
    images = web.load_images([f"{http_base}/held/{i}" for i in range(4)])
    assert time.monotonic() - start < 3.5  # one after another: at least 4 s
    assert InFlight.peak == 4 and all(same_pixels(im, IMAGE) for im in images)
    InFlight.reset()
    threads = [threading.Thread(target=web.load_images,
                                args=([f"{http_base}/held/{r}-{i}" for i in range(3)],))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert InFlight.peak == 6  # two requests of three images each, all at once


def test_concurrent_fetches_keep_each_limit_and_name_the_first_failing_part(http_base):
    from qwenserve.entrypoints.media_parts import ImageSource, load_images

    web = connector(allowed_media_domains=("127.0.0.1",), max_download_bytes=100_000)
    results = web.load_images([f"{http_base}/img.png", f"{http_base}/endless",
                               f"http://localhost:{http_base.rsplit(':', 1)[1]}/img.png",
                               f"{http_base}/missing"])
    assert same_pixels(results[0], IMAGE)
    assert [type(r) for r in results[1:]] == [MediaError] * 3
    assert "larger than 100000 bytes" in str(results[1])
    assert "host 'localhost' is not in --allowed-media-domains" in str(results[2])
    assert "HTTP 404" in str(results[3])
    sources = [ImageSource(f"messages.0.content.{i}", url=url) for i, url in enumerate(
        [f"{http_base}/img.png", f"{http_base}/missing", f"{http_base}/text"])]
    with pytest.raises(MediaError, match="messages.0.content.1: fetching .* HTTP 404") as e:
        load_images(sources, web)
    assert e.value.param == "messages.0.content.1"


def test_limits_from_vllm_environment(monkeypatch):
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "7")
    monkeypatch.setenv("VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB", "2")
    monkeypatch.setenv("VLLM_MAX_IMAGE_PIXELS", "1000")
    config = MediaConfig()
    assert (config.fetch_timeout_s, config.max_download_bytes, config.max_image_pixels) == (
        7.0, 2 << 20, 1000)
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="VLLM_IMAGE_FETCH_TIMEOUT='soon' is not a number"):
        MediaConfig()
