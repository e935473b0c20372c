"""Hostile and careless clients against a real server behind ``--root-path`` with ``--api-key``
(issue 13): every path decision ignores the root path, limits answer with the flag to change."""

from __future__ import annotations

import socket
import time

import httpx
from oai_server import ROOT, SERVED, RemoteServer


def test_root_path_keeps_the_api_key_required(guarded):
    """uvicorn puts the root path in front of ``scope["path"]``; auth must still see ``/v1``.
    (The proxy in front strips the root path, so clients reach ``/v1/...`` here.)"""
    url = guarded.base_url
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
    body = {"model": SERVED, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
    ok = httpx.get(url + "/v1/models", headers=guarded.headers, timeout=30)
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == SERVED
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # open, as in vLLM
    # With the prefix left on, the router sees /api/v1/models: no route, and never a 200.
    assert httpx.get(url + ROOT + "/v1/models", timeout=30).status_code in (401, 404)


def test_without_root_path_the_key_is_required(server):
    assert httpx.get(server.base_url + "/v1/models", timeout=30).status_code == 401


def _health_while(guarded: RemoteServer, send) -> tuple[httpx.Response, float]:
    """Run ``send()`` in a thread; poll /health meanwhile. -> (its response, slowest /health)."""
    import threading

    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", send()))
    thread.start()
    slowest = 0.0
    time.sleep(0.2)  # let the upload start
    while thread.is_alive():
        t0 = time.monotonic()
        assert httpx.get(guarded.base_url + "/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.05)
    thread.join()
    return box["r"], slowest


def test_huge_tokenize_is_refused_by_length_and_health_stays_fast(guarded):
    prompt = "Hello world! How are you today? " * 150_000  # 4.8 MB, no key needed
    r, slowest = _health_while(
        guarded,
        lambda: httpx.post(guarded.base_url + "/tokenize", json={"prompt": prompt}, timeout=120),
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "--max-model-len" in err["message"] and err["param"] == "prompt"
    assert slowest < 1.0


def test_tokenizing_runs_off_the_event_loop(guarded):
    """Within the length cap, tokenizing still takes seconds: /health must not wait for it."""
    body = {"model": SERVED, "prompt": "Hello world! How are you today? " * 20_000}
    r, slowest = _health_while(guarded, lambda: guarded.post("/v1/completions", json=body))
    assert r.status_code == 400 and "maximum context length" in r.text, r.text
    assert slowest < 1.0


def test_template_rendering_runs_off_the_event_loop(guarded):
    """10,000 messages: rendering and tokenizing take seconds; /health must not wait for them."""
    messages = [{"role": "user", "content": f"message {i} " * 3} for i in range(10_000)]
    body = {"model": SERVED, "messages": messages, "max_tokens": 1}
    r, slowest = _health_while(
        guarded,
        lambda: guarded.post("/v1/chat/completions", json=body, timeout=120),
    )
    assert r.status_code == 400 and "maximum context length" in r.text, r.text
    assert slowest < 1.0


def test_reset_prefix_cache_only_in_dev_mode(guarded, server):
    assert httpx.post(guarded.base_url + "/reset_prefix_cache", timeout=30).status_code == 404
    assert guarded.post("/reset_prefix_cache").status_code == 404  # a key does not open it
    assert server.post("/reset_prefix_cache").status_code == 200  # QWENSERVE_SERVER_DEV_MODE=1


def test_prompts_are_cut_in_request_log_lines(server):
    """--max-log-len defaults to 500 characters: one log line per request stays short."""
    prompt = "Hello world! " * 400  # 5200 characters
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 100}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    request_id = r.json()["id"]
    lines = [line for line in server.log().splitlines() if request_id in line]
    assert lines and all(len(line) < 800 for line in lines), max(map(len, lines))


def test_one_request_over_the_sequence_cap_is_a_400(guarded):
    body = {"model": SERVED, "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1}
    r = guarded.post("/v1/completions", json=body)
    assert r.status_code == 400 and "--max-sequences-per-request" in r.text, r.text
    assert "9 sequences" in r.json()["error"]["message"]


def test_a_full_queue_is_a_429_until_the_work_is_gone(guarded):
    body = {"model": SERVED, "prompt": "Hi", "n": 4, "max_tokens": 2000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    url = guarded.base_url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=guarded.headers, timeout=60) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # (kept: a dropped iterator closes the connection)
        next(lines)  # 2 sequences run, 2 wait: the queue is full
        small = {"model": SERVED, "prompt": "Hi", "max_tokens": 1}
        r = guarded.post("/v1/completions", json=small)
        assert r.status_code == 429 and "--max-queued-sequences" in r.text, r.text
        chat = {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        assert guarded.post("/v1/chat/completions", json=chat).status_code == 429
    guarded.wait_idle(timeout_s=30)  # the client left: its sequences are given back
    assert guarded.post("/v1/completions", json=small).status_code == 200


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the server closes ``sock`` within ``seconds`` (reads what it sends meanwhile)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_connection_that_sends_nothing_is_closed(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        assert _closed_within(sock, 6)


def test_trickled_headers_are_cut_off(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        try:
            for _ in range(40):  # one byte every 0.2 s would take 8 s
                sock.sendall(b"X")
                time.sleep(0.2)
        except OSError:
            pass  # closed under us: what we want
        assert time.monotonic() - start < 6
        assert _closed_within(sock, 3)


def test_an_idle_keep_alive_connection_is_closed(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert _closed_within(sock, 5)


def _post_head(server: RemoteServer, path: str, length: int) -> bytes:
    key = server.headers["Authorization"].encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n").encode() + b"Authorization: " + key + b"\r\n\r\n"


def test_a_trickled_body_gets_a_408_and_is_cut_off(guarded):
    """Headers complete, then the body a byte at a time: the handler waiting for it must not be
    held past QWENSERVE_HTTP_BODY_TIMEOUT (2 s here), and the server keeps serving."""
    body = b'{"model": "%s", "prompt": "Hi", "max_tokens": 1}' % SERVED.encode()
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        sock.sendall(_post_head(guarded, "/v1/completions", len(body)) + body[:5])
        start, answer = time.monotonic(), b""
        sock.settimeout(0.2)
        for byte in body[5:]:
            try:
                sock.sendall(bytes([byte]))
                answer += sock.recv(65536)
                if answer:
                    break
            except TimeoutError:
                continue
            except OSError:
                break
        assert time.monotonic() - start < 4  # len(body) * 0.2 s would be ~10 s
        sock.settimeout(3)
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"QWENSERVE_HTTP_BODY_TIMEOUT" in answer
    assert guarded.get("/health", timeout=2).status_code == 200


def test_a_body_sent_in_time_is_served(guarded):
    body = b'{"model": "%s", "prompt": "Hi", "max_tokens": 1}' % SERVED.encode()
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        sock.sendall(_post_head(guarded, "/v1/completions", len(body)) + body[:5])
        time.sleep(1)  # a pause under the deadline
        sock.sendall(body[5:])
        sock.settimeout(30)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
