"""ZmqChannel: the PUSH/PULL pair every engine-core client uses (real sockets over ipc and tcp)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwenserve.engine.zmq_channel import ZmqChannel


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[ZmqChannel, ZmqChannel]]:
    """Two channels wired to each other: a binds, b connects (as a client and its engine), once
    both connections are up (a bound PUSH has no peer to queue for until b has connected)."""
    a_out, b_out = f"ipc://{tmp_path}/a-out", f"ipc://{tmp_path}/b-out"
    a, b = ZmqChannel(), ZmqChannel()
    a.bind(a_out, b_out)
    b.connect(b_out, a_out)
    deadline = time.monotonic() + 5
    while not a.send("ping") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.recv(5000) == "ping"
    assert b.send("ready") and a.recv(5000) == "ready"
    yield a, b
    a.close()  # a second close (the tests close some) does nothing
    b.close()


def test_messages_cross_both_ways_in_order(pair: tuple[ZmqChannel, ZmqChannel]) -> None:
    a, b = pair
    for i in range(3):
        assert a.send({"n": i})
    assert [b.recv(2000) for _ in range(3)] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert b.send(("back", [1, 2]))
    assert a.recv(2000) == ("back", [1, 2])
    assert a.recv(0) is None


def test_send_after_the_peer_died_returns_false_and_never_blocks(
        pair: tuple[ZmqChannel, ZmqChannel]) -> None:
    a, b = pair
    b.close()  # the peer is gone: its connection drops
    deadline = time.monotonic() + 5
    sent = True
    while sent and time.monotonic() < deadline:
        started = time.monotonic()
        sent = a.send("anyone?")
        assert time.monotonic() - started < 0.5  # NOBLOCK: a dead peer never stalls a sender
        time.sleep(0.01)
    assert not sent


def test_send_last_drops_every_later_send(pair: tuple[ZmqChannel, ZmqChannel]) -> None:
    a, b = pair
    a.send_last("bye")
    assert a.closing
    assert not a.send("too late")
    assert b.recv(2000) == "bye"
    assert b.recv(200) is None


def test_close_while_receiving_stops_the_thread_after_delivering(
        pair: tuple[ZmqChannel, ZmqChannel]) -> None:
    a, b = pair
    got: list[object] = []
    ended = threading.Event()
    a.start_receiving(got.append, "test-receiver", on_end=ended.set)
    for i in range(100):
        b.send(i)
    deadline = time.monotonic() + 5
    while len(got) < 100 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == list(range(100))
    started = time.monotonic()
    a.close()  # while its thread polls: the thread stops first, then the sockets close
    assert ended.is_set()
    assert time.monotonic() - started < 2
    assert not a.send("after close")


@pytest.mark.timeout(30)
def test_a_watched_tcp_peer_that_drops_ends_the_receiving_thread() -> None:
    head = ZmqChannel(watch_peer=True)
    push_address, pull_address = head.bind_to_random_ports("tcp://127.0.0.1")
    node = ZmqChannel()
    node.connect(pull_address, push_address)
    assert node.send("ready") and head.recv(5000) == "ready"
    assert not head.peer_disconnected()
    ended = threading.Event()
    head.start_receiving(lambda message: None, "test-watch", on_end=ended.set)
    node.close()  # the node goes away: the disconnect ends the head's receiving thread
    assert ended.wait(10)
    assert head.wait_receiving(1)
    head.close()
