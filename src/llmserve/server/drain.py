"""Graceful drain on SIGTERM (no torch): stop accepting, finish in-flight requests up to a
drain timeout, abort the rest, exit 0.

Kubernetes sends SIGTERM, waits ``terminationGracePeriodSeconds``, then SIGKILLs. On
SIGTERM (or SIGINT) :class:`DrainingServer`:

1. sets the shared :class:`DrainState`, so :class:`DrainGate` answers every new request
   on a kept-alive connection with 503 (``Connection: close``, ``Retry-After``), ``/ready``
   included (the pod leaves the Service's endpoints);
2. lets uvicorn close its listening sockets (new connections are refused) and end idle
   keep-alive connections;
3. waits up to ``--drain-timeout`` seconds for in-flight responses (streams included)
   to finish, then cancels what remains: a cancelled response closes its engine stream,
   which aborts the request and frees its KV;
4. returns from ``run()`` without re-raising the signal (uvicorn re-raises it by default,
   which would kill the process with status 143 before the engine shuts down), so
   ``llmserve serve`` shuts the engine down and exits 0.
"""
from __future__ import annotations

import json
import logging
import signal
import threading
from types import FrameType
from typing import Any, Awaitable, Callable, Optional

import uvicorn

logger = logging.getLogger(__name__)

#: paths still answered while draining (the process is alive; liveness must not fail)
LIVENESS_PATHS = frozenset({"/health"})


class DrainState:
    """Set once the server has started to drain."""

    def __init__(self) -> None:
        self._event = threading.Event()

    @property
    def draining(self) -> bool:
        return self._event.is_set()

    def start(self) -> None:
        self._event.set()


class DrainGate:
    """Pure-ASGI outermost layer: 503 for new HTTP requests once draining."""

    def __init__(self, app: Callable[..., Awaitable[None]], state: DrainState,
                 retry_after_s: int = 1) -> None:
        self.app = app
        self.state = state
        self.retry_after = str(retry_after_s).encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if (scope.get("type") != "http" or not self.state.draining
                or scope.get("path") in LIVENESS_PATHS):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {
            "message": "the server is shutting down; retry on another replica",
            "type": "service_unavailable", "param": None, "code": "draining"}}).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", self.retry_after), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """A uvicorn Server that drains on SIGTERM / SIGINT and then returns normally."""

    def __init__(self, config: uvicorn.Config, state: Optional[DrainState] = None) -> None:
        super().__init__(config)
        self.drain = state or DrainState()

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        if not self.drain.draining:
            logger.info("signal %d: draining (%d connection(s) open; up to %ss for in-flight "
                        "requests)", sig, len(self.server_state.connections),
                        self.config.timeout_graceful_shutdown)
        self.drain.start()
        super().handle_exit(sig, frame)
        captured: Any = getattr(self, "_captured_signals", None)
        if sig == signal.SIGTERM and isinstance(captured, list) and sig in captured:
            captured.remove(sig)   # a drained SIGTERM is a clean exit, not a kill
