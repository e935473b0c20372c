"""Images from URLs: ``data:`` (base64), ``file://`` under an allowed folder, ``http(s)://`` from
allowed hosts; decoded to RGB with limits, every failure a ``MediaError`` that names the fix.

    data:image/png;base64,...   always (its size is bounded by the request body)
    file:///abs/path.png        only under --allowed-local-media-path (after resolving links)
    https://host/x.jpg          only when host is in --allowed-media-domains; redirects are
                                followed only to allowed hosts; size cap and a total deadline

Limits come from vLLM's environment variables: ``VLLM_IMAGE_FETCH_TIMEOUT`` (5 s),
``VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB`` (256), ``VLLM_MAX_IMAGE_PIXELS`` (178,956,970).
Unlike vLLM, http(s) URLs are refused unless ``--allowed-media-domains`` names their host: a
server should not fetch arbitrary URLs for anonymous clients by default.

Several images are loaded at once (``load_images``): a request's URLs, and those of concurrent
requests, share one pool of fetch threads per connector (``MAX_CONCURRENT_FETCHES``), so a
request with N remote images waits about as long as its slowest, not the sum; each image keeps
its own size cap and deadline.
"""

from __future__ import annotations

import base64
import binascii
import io
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urljoin, urlsplit

from qwenserve import envs
from qwenserve.entrypoints.chat_utils import ChatMessageError

if TYPE_CHECKING:
    import httpx
    from PIL import Image

# Still-image formats decoded in-process; EPS (Ghostscript), WMF and stub formats are refused.
ALLOWED_IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF", "ICO", "PPM", "TGA", "DIB")
MAX_REDIRECTS = 5
MAX_CONCURRENT_FETCHES = 16  # fetch threads per connector (I/O bound: they wait on sockets)


class MediaError(ChatMessageError):
    """A media input the server cannot use (400 in the server, ``ValueError`` offline)."""


@dataclass(frozen=True)
class MediaConfig:
    """Where images may come from, and how big they may be."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    fetch_timeout_s: float = field(default_factory=envs.image_fetch_timeout_s)
    max_download_bytes: int = field(default_factory=envs.max_media_download_bytes)
    max_image_pixels: int = field(default_factory=envs.max_image_pixels)

    def __post_init__(self) -> None:
        path = self.allowed_local_media_path
        if path and not Path(path).resolve().is_dir():
            raise ValueError(f"--allowed-local-media-path {path}: no such directory")


class MediaConnector:
    """Loads images, blocking: the server calls it on its CPU pool, never on the event loop."""

    def __init__(self, config: MediaConfig) -> None:
        self.config = config
        root = config.allowed_local_media_path
        self.local_root = Path(root).resolve() if root else None
        self._pool: ThreadPoolExecutor | None = None  # made on the first multi-image load
        self._pool_lock = threading.Lock()

    def load_images(self, urls: Sequence[str]) -> list[Image.Image | MediaError]:
        """Load several images concurrently (fetch and decode in the connector's threads);
        in order, each the image or the ``MediaError`` that refused it."""
        if len(urls) < 2:
            return [self._try_load(url) for url in urls]
        pool = self._fetch_pool()
        return [f.result() for f in [pool.submit(self._try_load, url) for url in urls]]

    def _try_load(self, url: str) -> Image.Image | MediaError:
        try:
            return self.load_image(url)
        except MediaError as e:
            return e

    def _fetch_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(MAX_CONCURRENT_FETCHES,
                                                thread_name_prefix="qwenserve-media")
            return self._pool

    def load_image(self, url: str) -> Image.Image:
        if not isinstance(url, str) or not url:
            raise MediaError("an image URL must be a non-empty string")
        scheme = urlsplit(url).scheme.lower()
        if scheme == "data":
            return decode_image(self._data_url_bytes(url), self.config.max_image_pixels)
        if scheme == "file":
            return decode_image(self._file_bytes(url), self.config.max_image_pixels)
        if scheme in ("http", "https"):
            return decode_image(self._download(url), self.config.max_image_pixels)
        raise MediaError(f"image URL scheme {scheme or '(none)'!r} is not supported; use a "
                         "data: URL (base64), an http(s) URL or a file:// URL")

    def _data_url_bytes(self, url: str) -> bytes:
        header, comma, payload = url[5:].partition(",")
        if not comma:
            raise MediaError("the data URL has no ',' between its header and its data")
        if not header.endswith(";base64"):
            raise MediaError("only base64 data URLs are supported "
                             "(data:image/png;base64,...)")
        if len(payload) * 3 // 4 > self.config.max_download_bytes:
            raise MediaError(f"the data URL holds more than {self.config.max_download_bytes} "
                             "bytes (VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB)")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"the data URL's base64 data cannot be decoded ({e})") from e

    def _file_bytes(self, url: str) -> bytes:
        if self.local_root is None:
            raise MediaError("Cannot load local files without `--allowed-local-media-path`; "
                             "start the server with it, or send the image as a data URL")
        parts = urlsplit(url)
        path = Path(unquote(parts.netloc + parts.path)).resolve()
        if not path.is_relative_to(self.local_root):
            raise MediaError(f"the file {path} is not under --allowed-local-media-path "
                             f"{self.local_root}")
        if not path.is_file():
            raise MediaError(f"no such file under --allowed-local-media-path: {path}")
        if path.stat().st_size > self.config.max_download_bytes:
            raise MediaError(f"the file {path} is larger than "
                             f"{self.config.max_download_bytes} bytes")
        return path.read_bytes()

    def _check_host(self, url: str) -> None:
        host = (urlsplit(url).hostname or "").lower()
        allowed = [d.lower() for d in self.config.allowed_media_domains]
        if not allowed:
            raise MediaError("fetching images from http(s) URLs is disabled; start the server "
                             f"with --allowed-media-domains {host or 'HOST'} to allow it, or "
                             "send the image as a data URL")
        if host not in allowed:
            raise MediaError(f"the image URL's host {host!r} is not in --allowed-media-domains "
                             f"{allowed}")

    def _download(self, url: str) -> bytes:
        import httpx

        deadline = time.monotonic() + self.config.fetch_timeout_s
        with httpx.Client(timeout=self.config.fetch_timeout_s, follow_redirects=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                self._check_host(url)
                if urlsplit(url).scheme.lower() not in ("http", "https"):
                    raise MediaError("an image URL redirected to a non-http(s) URL")
                try:
                    with client.stream("GET", url) as response:
                        if response.is_redirect:
                            url = urljoin(url, response.headers.get("location", ""))
                            continue
                        return self._read_body(response, url, deadline)
                except httpx.TimeoutException as e:
                    raise MediaError(f"fetching the image at {url} timed out after "
                                     f"{self.config.fetch_timeout_s:g} s "
                                     "(VLLM_IMAGE_FETCH_TIMEOUT)") from e
                except httpx.HTTPError as e:
                    raise MediaError(f"fetching the image at {url} failed: {e}") from e
        raise MediaError(f"the image URL redirected more than {MAX_REDIRECTS} times")

    def _read_body(self, response: httpx.Response, url: str, deadline: float) -> bytes:
        if response.status_code >= 400:
            raise MediaError(f"fetching the image at {url} failed: HTTP {response.status_code}")
        limit = self.config.max_download_bytes
        too_big = MediaError(f"the image at {url} is larger than {limit} bytes "
                             "(VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB)")
        if int(response.headers.get("content-length") or 0) > limit:
            raise too_big
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > limit:
                raise too_big
            if time.monotonic() > deadline:
                raise MediaError(f"fetching the image at {url} took longer than "
                                 f"{self.config.fetch_timeout_s:g} s (VLLM_IMAGE_FETCH_TIMEOUT)")
        return bytes(body)


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """Bytes -> an RGB image (EXIF orientation applied, transparency over white)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=ALLOWED_IMAGE_FORMATS)
    except UnidentifiedImageError as e:
        raise MediaError("the data is not an image in a supported format "
                         f"({', '.join(ALLOWED_IMAGE_FORMATS)})") from e
    except Image.DecompressionBombError as e:
        raise MediaError(f"the image is too large to decode safely ({e})") from e
    width, height = image.size
    if width * height > max_pixels:
        raise MediaError(f"the image is {width}x{height} = {width * height} pixels, more than "
                         f"the limit of {max_pixels} (VLLM_MAX_IMAGE_PIXELS)")
    try:
        image = ImageOps.exif_transpose(image)
        image.load()
    except (OSError, SyntaxError, ValueError) as e:
        raise MediaError(f"the image data is truncated or corrupt ({e})") from e
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited over white (vLLM's default background)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")

