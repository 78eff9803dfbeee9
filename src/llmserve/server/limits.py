"""Connection-level limits of the HTTP server: sizes, timeouts, connection cap.

A client that sends its headers or its body slowly (or never finishes them) would
otherwise hold a socket and a task forever. :class:`ServerLimits` bounds that:

* ``header_read_timeout_s``: the request line and headers must arrive within this
  many seconds of the connection opening, or of the first byte of a following request
  on a kept-alive connection; otherwise the server answers ``408`` and closes the
  connection (:class:`~llmserve.server.timed_h11.TimedH11Protocol`, a subclass of
  uvicorn's h11 protocol);
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

No torch and no HTTP framework here (the gateway config builds these limits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any


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
        from llmserve.server.timed_h11 import timed_h11_protocol

        return {"limit_concurrency": self.max_connections,
                "timeout_keep_alive": self.keep_alive_timeout_s,
                "h11_max_incomplete_event_size": self.max_header_bytes,
                "http": timed_h11_protocol(self.header_read_timeout_s)}
