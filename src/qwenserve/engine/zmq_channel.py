"""ZmqChannel: one PUSH socket out and one PULL socket in, between two processes.

Every client of an engine core (its own process, a remote data-parallel node, the hub of
``--api-server-count``) talks to it the same way, so the rules live here once:

    send(message)        never blocks (high-water marks 0, NOBLOCK); a gone peer is not an
                         error: the owner learns of the death another way (process watch,
                         heartbeats, its pipe), so the message is dropped and send says False
    send_last(message)   the owner is closing: this is the last message; later sends drop
    recv(timeout_ms)     one message or None (start-up handshakes, before receiving starts)
    start_receiving(fn)  a thread hands every message to fn until close(), a ZMQ error, or
                         (when the channel watches for it) the peer's disconnection
    close()              stops that thread first, then closes the sockets (a socket belongs to
                         one thread at a time), with the linger the owner chooses

Messages are pickles (protocol 5): the two ends are one program, and the links are local or
between the deployment's own nodes.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable

import zmq

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
_RECEIVE_POLL_MS = 500  # how soon the receiving thread notices close()


def encode(message: object) -> bytes:
    return pickle.dumps(message, protocol=5)


def decode(payload: bytes) -> object:
    return pickle.loads(payload)


def set_heartbeats(sock: zmq.Socket) -> None:
    """ZeroMQ heartbeats: a dead or unreachable TCP peer drops the connection within seconds."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def disconnected(monitor: zmq.Socket) -> bool:
    """Whether a monitor socket (``EVENT_DISCONNECTED``) has a disconnection waiting."""
    from zmq.utils.monitor import recv_monitor_message

    try:
        event = recv_monitor_message(monitor, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return bool(event["event"] & zmq.EVENT_DISCONNECTED)


class ZmqChannel:
    """The PUSH/PULL pair of one peer; see the module docstring.

    ``ctx``: a shared context (the channel then closes only its sockets), or None for a context
    of its own. ``watch_peer``: heartbeats on both sockets and a monitor on the receiving one,
    so that a dropped TCP peer ends the receiving thread (remote nodes).
    """

    def __init__(self, ctx: zmq.Context | None = None, watch_peer: bool = False) -> None:
        self._owns_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._push = self._ctx.socket(zmq.PUSH)
        self._pull = self._ctx.socket(zmq.PULL)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the peer drains it
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._monitor: zmq.Socket | None = None
        if watch_peer:
            for sock in (self._push, self._pull):
                set_heartbeats(sock)
            self._monitor = self._pull.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._send_lock = threading.Lock()
        self._closing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- endpoints ----------------------------------------------------------------------------
    def bind(self, push_address: str, pull_address: str) -> None:
        self._push.bind(push_address)
        self._pull.bind(pull_address)

    def bind_to_random_ports(self, host: str) -> tuple[str, str]:
        """Bind both sockets on ``host`` (``tcp://ADDRESS``); their addresses (push, pull)."""
        return (f"{host}:{self._push.bind_to_random_port(host)}",
                f"{host}:{self._pull.bind_to_random_port(host)}")

    def connect(self, push_address: str, pull_address: str) -> None:
        self._push.connect(push_address)
        self._pull.connect(pull_address)

    # ---- sending --------------------------------------------------------------------------------
    @property
    def closing(self) -> bool:
        return self._closing

    def send(self, message: object) -> bool:
        """Queue ``message`` for the peer; False when closing or the peer is gone."""
        payload = encode(message)
        with self._send_lock:
            return not self._closing and self._send_now(payload)

    def send_last(self, message: object | None = None) -> None:
        """Send ``message`` (unless closing already) and drop every later send."""
        payload = None if message is None else encode(message)
        with self._send_lock:
            if not self._closing and payload is not None:
                self._send_now(payload)
            self._closing = True

    def _send_now(self, payload: bytes) -> bool:
        try:
            self._push.send(payload, zmq.NOBLOCK)
            return True
        except zmq.ZMQError:  # zmq.Again included: no peer to take it
            return False

    # ---- receiving ------------------------------------------------------------------------------
    def recv(self, timeout_ms: int) -> object | None:
        """One message within ``timeout_ms``, or None (only before ``start_receiving``)."""
        if not self._pull.poll(timeout_ms):
            return None
        return decode(self._pull.recv())

    def peer_disconnected(self) -> bool:
        """With ``watch_peer``: whether the peer's connection dropped (before receiving starts)."""
        return (self._monitor is not None and bool(self._monitor.poll(0))
                and disconnected(self._monitor))

    def start_receiving(self, handle: Callable[[object], None], name: str,
                        on_end: Callable[[], None] | None = None) -> None:
        """Hand each message to ``handle`` on a thread; ``on_end`` runs when the thread ends."""
        self._thread = threading.Thread(target=self._receive, args=(handle, on_end), name=name,
                                        daemon=True)
        self._thread.start()

    def _receive(self, handle: Callable[[object], None],
                 on_end: Callable[[], None] | None) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(_RECEIVE_POLL_MS))
                if self._monitor in events and disconnected(self._monitor):
                    break
                if self._pull not in events:
                    continue
                message = decode(self._pull.recv())
            except zmq.ZMQError:
                break
            handle(message)
        if on_end is not None:
            on_end()

    def wait_receiving(self, timeout_s: float) -> bool:
        """Wait for the receiving thread to end by itself (the peer left); False on timeout."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ---- closing --------------------------------------------------------------------------------
    def close(self, linger_ms: int = 0) -> None:
        """Stop receiving, then close the sockets; what is still queued out gets ``linger_ms``.
        Once: a second call does nothing."""
        with self._send_lock:
            self._closing = True
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        self._pull.close(linger=0)
        self._push.close(linger=linger_ms)
        if self._owns_ctx:
            self._ctx.term()


__all__ = ["ZmqChannel", "decode", "disconnected", "encode", "set_heartbeats"]
