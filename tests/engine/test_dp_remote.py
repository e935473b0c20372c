"""The head's handshake with ``--headless`` nodes, over loopback TCP, without engines."""

from __future__ import annotations

import pickle
import socket
import time

import pytest
import zmq

from qwenserve.engine.core_client import EngineStartupError
from qwenserve.engine.dp_config import DataParallelConfig
from qwenserve.engine.dp_remote import DPHello, DPRefused, DPWelcome, RemoteReplicas


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hello(port: int, hello: DPHello) -> object:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(pickle.dumps(hello))
        assert sock.poll(5000), "the head did not answer"
        return pickle.loads(sock.recv())
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def head():
    dp = DataParallelConfig(size=3, size_local=1, rpc_port=_free_port())
    replicas = RemoteReplicas(dp)
    yield replicas
    replicas.close_handshake()
    for link in replicas.links.values():
        link.shutdown()


def test_the_head_welcomes_each_remote_rank_once(head):
    port = head.dp.rpc_port
    assert sorted(head.links) == [1, 2]
    welcome = _hello(port, DPHello(1, 3, time.monotonic() - 100.0, "node-a"))
    assert isinstance(welcome, DPWelcome)
    assert welcome.input_address == head.links[1].input_address
    assert welcome.input_address.startswith("tcp://127.0.0.1:")
    assert head.links[1].joined.is_set() and head.links[1].peer == "node-a"
    assert head.links[1].clock_offset_s == pytest.approx(100.0, abs=5.0)
    again = _hello(port, DPHello(1, 3, time.monotonic(), "node-b"))
    assert isinstance(again, DPRefused) and "already joined from node-a" in again.message
    wrong_size = _hello(port, DPHello(2, 4, time.monotonic(), "node-c"))
    assert isinstance(wrong_size, DPRefused) and "--data-parallel-size 3" in wrong_size.message
    head_rank = _hello(port, DPHello(0, 3, time.monotonic(), "node-d"))
    assert isinstance(head_rank, DPRefused) and "--data-parallel-start-rank" in head_rank.message


def test_a_rank_that_never_joins_times_out_with_the_setting_named(head):
    head.deadline = time.monotonic() + 0.3
    with pytest.raises(EngineStartupError, match="QWENSERVE_ENGINE_READY_TIMEOUT_S"):
        head.wait_ready(2)


def test_a_taken_rpc_port_is_one_clear_error(head):
    with pytest.raises(EngineStartupError, match="--data-parallel-rpc-port"):
        RemoteReplicas(head.dp)
