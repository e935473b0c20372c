"""uvicorn's h11 protocol with read deadlines: a connection that has not finished sending a
request's headers within ``QWENSERVE_HTTP_HEADER_TIMEOUT`` seconds is closed, and a request
whose body has not fully arrived ``QWENSERVE_HTTP_BODY_TIMEOUT`` seconds after its headers gets a
408 and is closed.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but never a fresh connection
that sends nothing, nor one that trickles its headers or its body a byte at a time, so a few
hundred such clients could hold every file descriptor and every request handler (which waits
for the body). Both deadlines are totals, not gaps between packets: trickling does not extend
them. The header timer runs while the client is between requests (h11's ``their_state`` is
``IDLE``); the body timer from the end of the headers while the body is incomplete
(``SEND_BODY``). The response is not timed here.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from qwenserve.entrypoints.openai.errors import error_body


class TimedH11Protocol(H11Protocol):
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # (not re-armed per chunk: trickling does not extend it)
        super().data_received(data)
        state = self.conn.their_state
        if state is not h11.IDLE:
            self._disarm_header_timer()
        if state is h11.SEND_BODY:
            if self._body_timer is None:  # once per request
                self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timeout)
        else:
            self._disarm_body_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._disarm_body_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.debug("Closing a connection that sent no complete request headers")
            self.transport.close()

    def _body_timeout(self) -> None:
        """408 (when no response has started), then close; the handler waiting for the body
        sees a client disconnect, as uvicorn reports one."""
        self._body_timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        self.logger.info("Closing a connection whose request body did not arrive within %.0f s "
                         "(QWENSERVE_HTTP_BODY_TIMEOUT)", self.body_timeout_s)
        cycle = self.cycle
        if cycle is not None and not cycle.response_started \
                and self.conn.our_state is h11.SEND_RESPONSE:
            message = (f"The request body did not arrive within {self.body_timeout_s:g} s "
                       "(QWENSERVE_HTTP_BODY_TIMEOUT)")
            body = json.dumps(error_body(message, 408)).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            self.transport.write(self.conn.send(h11.Response(status_code=408, headers=headers))
                                 + self.conn.send(h11.Data(data=body))
                                 + self.conn.send(h11.EndOfMessage()))
        if cycle is not None:  # the handler's receive() answers http.disconnect; sends are dropped
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def timed_protocol(header_timeout_s: float, body_timeout_s: float) -> type[TimedH11Protocol]:
    return type("H11Protocol", (TimedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})
