"""Connection-level limits of the HTTP server: sizes, timeouts, connection cap.

A client that sends its headers or its body slowly (or never finishes them) would
otherwise hold a socket and a task forever. :class:`ServerLimits` bounds that:

* ``header_read_timeout_s``: the request line and headers must arrive within this
  many seconds of the connection opening, or of the first byte of a following request
  on a kept-alive connection; otherwise the server answers ``408`` and closes the
  connection (:func:`timed_h11_protocol`: a subclass of uvicorn's h11 protocol);
* ``body_read_timeout_s``: the whole body must arrive within this many seconds of the
  request's arrival, or the request gets a 408 (``body_read_timeout``) with
  ``Connection: close`` (enforced where the body is read, ``serving.read_body``);
* ``max_body_bytes``: larger bodies get 413 -- from ``Content-Length`` before
  anything is read, or as soon as a chunked body passes the limit;
* ``max_header_bytes``: h11's largest incomplete event (request line + headers);
  a bigger head is answered 400 by uvicorn;
* ``max_connections``: uvicorn's ``limit_concurrency``: above this many open
  connections or tasks, new requests get uvicorn's plain ``503``;
* ``keep_alive_timeout_s``: an idle kept-alive connection is closed after this long;
* ``tokenizer_threads``: threads that parse big bodies and tokenize prompts (shared
  fairly among tenants, see :mod:`llmserve.server.fair_pool`).

No torch here, and uvicorn only inside :func:`timed_h11_protocol` (the gateway config
builds these limits).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import math
from dataclasses import dataclass, fields
from typing import Any, Optional

logger = logging.getLogger(__name__)

#: The response written when a request's head does not arrive in time.
_HEADER_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                            b"content-length: 24\r\nconnection: close\r\n\r\n"
                            b"request header timed out")


#: Request bodies larger than this are decoded off the event loop (a worker thread).
PARSE_INLINE_BYTES = 64 * 1024

@dataclass(frozen=True)
class ServerLimits:
    """Limits of one HTTP server (see the module docstring); the defaults are safe."""

    max_body_bytes: int = 16 * 1024 * 1024
    body_read_timeout_s: float = 30.0
    header_read_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 1024
    max_header_bytes: int = 64 * 1024
    tokenizer_threads: int = 2

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{f.name} must be a finite number > 0, got {value!r}")

    def replace(self, **changes: Any) -> "ServerLimits":
        """A copy with the given fields changed; ``None`` values are ignored."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update({k: v for k, v in changes.items() if v is not None})
        return ServerLimits(**values)

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """The ``uvicorn.Config`` arguments these limits set."""
        return {"limit_concurrency": self.max_connections,
                "timeout_keep_alive": self.keep_alive_timeout_s,
                "h11_max_incomplete_event_size": self.max_header_bytes,
                "http": timed_h11_protocol(self.header_read_timeout_s)}


@functools.lru_cache(maxsize=1)
def _timed_h11_base() -> type:
    """uvicorn's h11 protocol plus a deadline on each request's head (built on first use,
    so that importing this module does not import uvicorn)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

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

    return TimedH11Protocol


def timed_h11_protocol(header_timeout_s: float) -> type:
    """uvicorn's ``http=`` protocol class: h11 with a ``header_timeout_s`` deadline on each
    request's head. The timer starts when the connection opens, and again when the first
    bytes of a following request arrive on a kept-alive connection; it stops once h11 has
    parsed the whole head. When it fires, a plain 408 is written and the connection closed."""
    return type("TimedH11Protocol", (_timed_h11_base(),), {"header_timeout_s": float(header_timeout_s)})
