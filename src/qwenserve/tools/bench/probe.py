"""Pre-flight checks: is the server there, does it accept our key, does it serve our model?

All three mistakes are common (a wrong port, a stale key, a model path where the served name was
expected) and all three would otherwise show up as a run of 100% failed requests after a long
dataset preparation. ``GET /v1/models`` answers all three in one round trip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from qwenserve.tools.bench.errors import BenchError, first_line

_RETRY_S = 1.0  # between readiness checks


@dataclass(frozen=True)
class ServerInfo:
    """What ``/v1/models`` told us: the served names and the model's ``root`` path, if any."""

    served_names: tuple[str, ...]
    model: str
    root: str | None


def probe_server(
    base_url: str,
    model: str | None,
    headers: dict[str, str],
    timeout_s: float = 10.0,
    ready_timeout_s: float = 0.0,
) -> ServerInfo:
    """Resolve the model name to use, or raise a one-line ``BenchError``."""
    url = f"{base_url}/v1/models"
    response = _get_models(url, headers, timeout_s, ready_timeout_s)
    if response.status_code in (401, 403):
        raise BenchError(
            f"API key refused by {base_url} (HTTP {response.status_code}); "
            "pass --api-key or set OPENAI_API_KEY"
        )
    if response.status_code == 404:
        if model is None:
            raise BenchError(f"{url} is not available (HTTP 404); pass --model NAME")
        return ServerInfo(served_names=(), model=model, root=None)  # cannot check; trust the user
    if response.status_code != 200:
        raise BenchError(f"{url} answered HTTP {response.status_code}: {response.text[:200]}")
    return _pick_model(url, response, model)


def _get_models(
    url: str, headers: dict[str, str], timeout_s: float, ready_timeout_s: float
) -> httpx.Response:
    """``GET /v1/models``; with ``ready_timeout_s`` > 0 (vLLM's ``--ready-check-timeout-sec``) it
    keeps asking while the server is unreachable or still starting (HTTP 503), so a benchmark
    can be launched together with its server."""
    deadline = time.monotonic() + ready_timeout_s
    while True:
        try:
            response = httpx.get(url, headers=headers, timeout=timeout_s)
        except httpx.HTTPError as e:
            if time.monotonic() < deadline:
                time.sleep(_RETRY_S)
                continue
            base_url = url.removesuffix("/v1/models")
            raise BenchError(f"cannot reach the server at {base_url}: {first_line(e)}") from e
        if response.status_code != 503 or time.monotonic() >= deadline:
            return response
        time.sleep(_RETRY_S)


def _pick_model(url: str, response: httpx.Response, model: str | None) -> ServerInfo:
    try:
        cards = response.json()["data"]
        names = tuple(str(card["id"]) for card in cards)
    except (ValueError, KeyError, TypeError) as e:
        raise BenchError(f"{url} did not answer an OpenAI model list: {first_line(e)}") from e
    if not names:
        raise BenchError(f"{url} lists no model; is the server still loading one?")
    chosen = names[0] if model is None else model
    if chosen not in names:
        raise BenchError(f"model {model!r} is not served at {url}; served: {', '.join(names)}")
    root = next((c.get("root") for c in cards if c.get("id") == chosen), None)
    return ServerInfo(served_names=names, model=chosen, root=root)
