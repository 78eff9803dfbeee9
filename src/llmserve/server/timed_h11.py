"""uvicorn's h11 protocol with a deadline on each request's head (slow-header clients).

Used through ``ServerLimits.uvicorn_kwargs()`` (``uvicorn.Config(http=...)``); see
:mod:`llmserve.server.limits`. No torch here.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

#: The response written when a request's head does not arrive in time.
_HEADER_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                            b"content-length: 24\r\nconnection: close\r\n\r\n"
                            b"request header timed out")


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline on each request's head (``header_timeout_s``).

    The timer starts when the connection opens, and again when the first bytes of a
    following request arrive on a kept-alive connection; it stops once h11 has parsed
    the whole head. When it fires, a plain 408 is written and the connection closed.
    """

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: Optional[asyncio.TimerHandle] = None
        super().connection_made(transport)
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _waiting_for_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_head():
            self._arm_head_timer()
        super().data_received(data)
        if not self._waiting_for_head() or self.transport.is_closing():
            self._disarm_head_timer()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._waiting_for_head():
            return
        logger.info("closing a connection from %s: request head not received within %.1fs",
                    self.client, self.header_timeout_s)
        self.transport.write(_HEADER_TIMEOUT_RESPONSE)
        self.transport.close()


def timed_h11_protocol(header_timeout_s: float) -> type:
    """A :class:`TimedH11Protocol` subclass with this header timeout (uvicorn's ``http=``)."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout_s": float(header_timeout_s)})
