"""A request rewritten with another body: how the Anthropic Messages and Responses
endpoints run a translated chat completion body through the chat request path. No torch.
"""
from __future__ import annotations

from typing import Any

from fastapi import Request


def with_body(request: Request, body: bytes) -> Request:
    """The same request (scope, state, client, disconnects) with another JSON body, and
    ``x-api-key`` given as a Bearer ``authorization`` when that header is absent."""
    headers = [(k, v) for k, v in request.scope["headers"]
               if k not in (b"content-length", b"content-type")]
    names = {k for k, _ in headers}
    api_key = request.headers.get("x-api-key")
    if api_key and b"authorization" not in names:
        headers.append((b"authorization", b"Bearer " + api_key.encode("latin-1")))
    headers += [(b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode())]
    scope = dict(request.scope)
    scope["headers"] = headers
    sent = False

    async def receive() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return Request(scope, receive)
