"""nginx and HAProxy configs: validated with ``nginx -t`` / ``haproxy -c``, then run for real in
front of two stand-in servers to check stickiness, spreading and unbuffered streaming."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import pytest
from ops_helpers import (
    Backends,
    first_event_delay_s,
    free_port,
    http_get,
    require_tool,
    run_deploy,
    wait_for_port,
)

pytestmark = pytest.mark.usefixtures("clean_env")

STICKY = {
    "none": [],
    "header": ["--sticky-header", "X-Session-ID"],
    "cookie": ["--sticky-cookie", "chat_id"],
}


def nginx_files(
    tmp_path: Path, backends: list[str], port: int, sticky: list[str]
) -> dict[str, Path]:
    lb_dir = tmp_path / "lb"
    lb_dir.mkdir()
    return run_deploy(tmp_path / "out", "nginx", "--backends", ",".join(backends), "--listen",
                      f"127.0.0.1:{port}", "--lb-dir", str(lb_dir), *sticky)  # fmt: skip


@pytest.mark.parametrize("sticky", list(STICKY))
def test_nginx_accepts_the_config(tmp_path, sticky):
    nginx = require_tool("nginx", "nginx-light")
    files = nginx_files(tmp_path, ["10.0.0.1:8000", "10.0.0.2:8000"], free_port(), STICKY[sticky])
    result = subprocess.run([nginx, "-t", "-e", "stderr", "-c", str(files["nginx.conf"])],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0 and "test is successful" in result.stderr, result.stderr
    site = files["qwenserve.conf"].read_text()
    for directive in ("least_conn;", "proxy_buffering off;", "proxy_read_timeout 3600s;",
                      "location = /health", "max_fails=3"):  # fmt: skip
        assert directive in site
    assert ("hash $http_x_session_id consistent;" in site) == (sticky == "header")
    assert ("hash $cookie_chat_id consistent;" in site) == (sticky == "cookie")


def test_nginx_default_paths_are_debians(tmp_path):
    files = run_deploy(tmp_path, "nginx")
    main = files["nginx.conf"].read_text()
    assert "pid /run/nginx-qwenserve.pid;" in main and "/var/log/nginx/qwenserve-error.log" in main


@pytest.fixture
def running_nginx(tmp_path):
    nginx = require_tool("nginx", "nginx-light")
    with Backends(2) as backends:
        port = free_port()
        files = nginx_files(tmp_path, backends.addresses, port, STICKY["header"])
        process = subprocess.Popen([nginx, "-e", "stderr", "-c", str(files["nginx.conf"]), "-g", "daemon off;"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            wait_for_port(port, process)
            yield port
        finally:
            process.terminate()
            process.wait(timeout=10)


def test_nginx_keeps_a_session_on_one_server_and_spreads_the_rest(running_nginx):
    port = running_nginx
    pinned = {http_get(port, headers={"X-Session-ID": "chat-42"})["server"] for _ in range(8)}
    assert len(pinned) == 1
    spread = Counter(
        http_get(port, headers={"X-Session-ID": f"chat-{i}"})["server"] for i in range(24)
    )
    assert set(spread) == {"s0", "s1"}
    assert set(Counter(http_get(port)["server"] for _ in range(8))) == {"s0", "s1"}
    assert http_get(port, "/health")["server"] in {"s0", "s1"}


def test_nginx_streams_without_buffering(running_nginx):
    first_s, total_s = first_event_delay_s(running_nginx)
    assert total_s >= 1.0 and first_s < 0.8, (first_s, total_s)


@pytest.mark.parametrize("sticky", list(STICKY))
def test_haproxy_accepts_the_config(tmp_path, sticky):
    haproxy = require_tool("haproxy", "haproxy")
    files = run_deploy(
        tmp_path, "haproxy", "--backends", "10.0.0.1:8000,10.0.0.2:8000", *STICKY[sticky]
    )
    result = subprocess.run([haproxy, "-c", "-f", str(files["haproxy.cfg"])],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    config = files["haproxy.cfg"].read_text()
    for directive in ("balance leastconn", "http-check send meth GET uri /health", "timeout server 1h",
                      "server server2 10.0.0.2:8000 check"):  # fmt: skip
        assert directive in config
    assert ("stick on req.hdr(X-Session-ID)" in config) == (sticky == "header")
    assert ("stick on req.cook(chat_id)" in config) == (sticky == "cookie")


def test_haproxy_rejects_a_broken_config(tmp_path):
    """The check above can fail: haproxy -c rejects what it does not understand."""
    haproxy = require_tool("haproxy", "haproxy")
    files = run_deploy(tmp_path, "haproxy")
    broken = files["haproxy.cfg"].read_text().replace("balance leastconn", "balance fewest-tokens")
    files["haproxy.cfg"].write_text(broken)
    result = subprocess.run(
        [haproxy, "-c", "-f", str(files["haproxy.cfg"])], capture_output=True, text=True
    )
    assert result.returncode != 0


def test_haproxy_keeps_a_session_on_one_server_and_streams(tmp_path):
    haproxy = require_tool("haproxy", "haproxy")
    with Backends(2) as backends:
        port = free_port()
        files = run_deploy(tmp_path, "haproxy", "--backends", ",".join(backends.addresses), "--listen",
                           f"127.0.0.1:{port}", "--sticky-header", "X-Session-ID")  # fmt: skip
        process = subprocess.Popen([haproxy, "-db", "-f", str(files["haproxy.cfg"])],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            wait_for_port(port, process)
            pinned = {
                http_get(port, headers={"X-Session-ID": "chat-7"})["server"] for _ in range(8)
            }
            spread = {http_get(port)["server"] for _ in range(8)}
            first_s, total_s = first_event_delay_s(port)
        finally:
            process.terminate()
            process.wait(timeout=10)
    assert len(pinned) == 1 and spread == {"s0", "s1"}
    assert total_s >= 1.0 and first_s < 0.8
