"""Pure-ASGI middleware around every HTTP request.

* stamps the arrival time (``scope["state"]["arrival_monotonic"]`` / ``["arrival_time"]``)
  before anything else runs, so TTFT and end-to-end latency start at arrival;
* accepts the client's ``X-Request-Id`` (1-128 characters of ``A-Za-z0-9._:-``) or
  generates one, stores it in ``scope["state"]["request_id"]`` and returns it on every
  response, errors included (a replayed response sets
  ``scope["state"]["response_request_id"]`` to return the original request's id);
* counts responses by endpoint and status class;
* is the catch-all: an unexpected exception becomes a logged 500 in the OpenAI shape
  (Starlette's own last-resort handler would answer in plain text and without the id);
  a client that disconnected before any response gets none.

It is plain ASGI (not BaseHTTPMiddleware) so streaming and disconnect detection pass
through untouched.
"""
from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect

from llmserve.contract.errors import OpenAIError
from llmserve.server.metrics.prometheus import ServerMetrics
from llmserve.server.stream.sse import ClientDisconnected

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def pick_request_id(raw_headers: list[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id if it is well-formed, else a fresh random id."""
    for name, value in raw_headers:
        if name.lower() == b"x-request-id":
            try:
                candidate = value.decode("ascii").strip()
            except UnicodeDecodeError:
                break
            if _VALID_REQUEST_ID.match(candidate):
                return candidate
            break
    return uuid.uuid4().hex


class RequestContextMiddleware:
    """See the module docstring."""

    def __init__(self, app: Callable[..., Awaitable[None]], metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["arrival_monotonic"] = time.monotonic()
        state["arrival_time"] = time.time()
        request_id = pick_request_id(scope.get("headers", []))
        state["request_id"] = request_id
        path = scope.get("path", "")
        started = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [h for h in message.get("headers", [])
                           if h[0].lower() != b"x-request-id"]
                sent_id = str(state.get("response_request_id") or request_id)
                headers.append((b"x-request-id", sent_id.encode("ascii", errors="replace")))
                message = {**message, "headers": headers}
                try:
                    self.metrics.count_http(path, int(message["status"]))
                except Exception:  # noqa: BLE001 - metrics must never break a response
                    logger.exception("counting an HTTP response failed")
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except (ClientDisconnected, ClientDisconnect):
            logger.info("client went away before the response (request %s)", request_id)
        except Exception:  # noqa: BLE001 - the catch-all 500
            logger.exception("unhandled error serving %s %s (request %s)",
                             scope.get("method"), path, request_id)
            if started:
                return  # headers are out; the server closes the connection
            err = OpenAIError(500, "The server had an error while processing your request",
                              code="internal_error")
            body = json.dumps(err.body()).encode("utf-8")
            await send_with_id({"type": "http.response.start", "status": 500, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode("ascii"))]})
            await send_with_id({"type": "http.response.body", "body": body, "more_body": False})
