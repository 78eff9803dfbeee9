"""``x-llmserve-replica``: the replica that served a response (no torch).

:class:`ReplicaHeaderMiddleware` (outermost ASGI layer of a router's front) gives each
HTTP request a fresh holder in a context variable; :meth:`RouterEngine.generate` records
in it the replica it picked (:func:`note_replica`; async generators run in their caller's
context, and the tasks a response spawns share the holder object). When the response
starts, the header names the replica(s), comma-separated in the order first used (a
request with several prompts can be spread over replicas; a retry adds the second one).
Responses that ran nothing (errors before routing, ``/health``) name none.
"""
from __future__ import annotations

import contextvars
from typing import Awaitable, Callable, Optional

REPLICA_HEADER = "x-llmserve-replica"

_served: contextvars.ContextVar[Optional[list[str]]] = contextvars.ContextVar(
    "llmserve_replicas_served", default=None)


def note_replica(name: str) -> None:
    """Record that the current HTTP request is being served by replica ``name``."""
    holder = _served.get()
    if holder is not None and name not in holder:
        holder.append(name)


class ReplicaHeaderMiddleware:
    """Adds ``x-llmserve-replica`` to every response that a replica served."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        holder: list[str] = []
        token = _served.set(holder)

        async def send_with_replica(message: dict) -> None:
            if message.get("type") == "http.response.start" and holder:
                headers = [h for h in message.get("headers", [])
                           if h[0].lower() != REPLICA_HEADER.encode()]
                headers.append((REPLICA_HEADER.encode(), ",".join(holder).encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_replica)
        finally:
            _served.reset(token)
