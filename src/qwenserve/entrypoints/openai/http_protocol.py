"""uvicorn's h11 protocol with a header-read timeout: a connection that has not finished sending
a request's headers within ``QWENSERVE_HTTP_HEADER_TIMEOUT`` seconds is closed.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but never a fresh connection
that sends nothing, nor one that trickles its headers a byte at a time, so a few hundred such
clients could hold every file descriptor. The timer runs while the client is between requests
(h11's ``their_state`` is ``IDLE``) and stops once a request's headers are complete; the body and
the response are not timed here.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # (not re-armed per chunk: trickling does not extend it)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.debug("Closing a connection that sent no complete request headers")
            self.transport.close()


def protocol_with_header_timeout(timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    return type("H11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": timeout_s})
