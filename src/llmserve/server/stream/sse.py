"""Server-sent events and client-disconnect detection, as plain ASGI.

Starlette's StreamingResponse notices a vanished client only when a send fails,
and uvicorn's ``send`` silently drops data once the peer is gone, so a request
waiting for its next token would keep running in the engine. Here a watcher task
waits on ``receive()`` for ``http.disconnect`` (uvicorn delivers it as soon as the
socket closes) and cancels the producer at once; the producer's ``finally`` then
closes the engine stream, which aborts the request.

All of this uses asyncio tasks rather than anyio cancel scopes on purpose:
asyncio cancellation is delivered once, so cleanup code (``await engine.abort``)
can still await after a cancellation.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import (
    TYPE_CHECKING,
    Any,
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    MutableMapping,
    Optional,
    TypeVar,
)

from starlette.responses import JSONResponse, Response

from llmserve.contract.errors import OpenAIError

if TYPE_CHECKING:
    from llmserve.contract.gateway_hook import CapturedResponse

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


def encode_event(payload: Any) -> bytes:
    """One SSE event: ``data: <compact JSON>\\n\\n``."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False,
                                   allow_nan=False).encode(
        "utf-8") + b"\n\n"


def encode_named_event(event: str, payload: dict[str, Any]) -> bytes:
    """One SSE event with a type line: ``event: <event>\\ndata: <compact JSON>\\n\\n``
    (Anthropic's and the Responses API's streams)."""
    return (f"event: {event}\ndata: " + json.dumps(payload, separators=(",", ":"),
                                                   ensure_ascii=False) + "\n\n").encode("utf-8")


def data_payloads(raw: bytes) -> list[str]:
    """The ``data:`` payloads of one or more encoded SSE events."""
    return [line[6:] for line in raw.decode("utf-8").split("\n") if line.startswith("data: ")]


async def sse_payloads(events: AsyncIterator[bytes]) -> AsyncGenerator[str, None]:
    """The ``data:`` payloads of an encoded SSE stream, one at a time; the stream is
    closed when the consumer stops (how the Messages and Responses translators read the
    chat stream)."""
    iterator = events.__aiter__()
    try:
        async for raw in iterator:
            for payload in data_payloads(raw):
                yield payload
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


class ClientDisconnected(Exception):
    """The client closed the connection before the response was sent (no response follows)."""


async def wait_for_disconnect(receive: Callable[[], Awaitable[MutableMapping[str, Any]]]) -> None:
    """Return when the server reports ``http.disconnect``. The body must already be read."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


async def _cancel_and_wait(*tasks: "asyncio.Future[Any]") -> None:
    for t in tasks:
        if not t.done():
            t.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_until_disconnect(
    work: Awaitable[T], receive: Callable[[], Awaitable[MutableMapping[str, Any]]]
) -> T:
    """Await ``work`` unless the client disconnects first.

    On disconnect ``work`` is cancelled (its cleanup runs) and ClientDisconnected is raised.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done() and not watcher.done():  # we were cancelled ourselves
            await _cancel_and_wait(task, watcher)
    if task.done():
        await _cancel_and_wait(watcher)
        return task.result()
    await _cancel_and_wait(task)
    raise ClientDisconnected()


class EventStreamResponse(Response):
    """An ASGI ``text/event-stream`` response over an async iterator of encoded events.

    Headers are sent only once the iterator yields its first event, so an
    :class:`OpenAIError` raised before that (e.g. the engine rejecting the
    parameters) is still answered with a proper JSON error and status. If the
    client disconnects, iteration is cancelled and the iterator closed; then
    ``on_close`` (if given) is awaited, in every case, exactly once.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: Optional[dict[str, str]] = None,
        on_close: Optional[Callable[[], Awaitable[None]]] = None,
    ) -> None:
        # Like StreamingResponse: no body attribute, so no content-length header.
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        merged = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        merged.update(headers or {})
        self.init_headers(merged)

    async def _send_error(self, send: Callable[[dict], Awaitable[None]], err: OpenAIError) -> None:
        body = json.dumps(err.body()).encode("utf-8")
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _pump(self, send: Callable[[dict], Awaitable[None]]) -> None:
        iterator = self.events.__aiter__()
        try:
            try:
                first: Optional[bytes] = await iterator.__anext__()
            except StopAsyncIteration:
                first = None
            except OpenAIError as err:
                await self._send_error(send, err)
                return
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            if first:
                await send({"type": "http.response.body", "body": first, "more_body": True})
            async for event in iterator:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable,
                       send: Callable) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                await _cancel_and_wait(watcher)
                pump.result()  # re-raise a failure of the producer
            else:
                logger.info("client disconnected during a stream; cancelling it")
                await _cancel_and_wait(pump)
        finally:
            await _cancel_and_wait(pump, watcher)
            if self.on_close is not None:
                await self.on_close()


#: Response header set on a response replayed from the idempotency store.
REPLAYED_HEADER = "Idempotent-Replayed"


def replay_response(stored: "CapturedResponse") -> Any:
    """The HTTP response for a stored one: the same SSE events, or the same JSON body
    (``Idempotent-Replayed: true`` unless it is a response-cache hit)."""
    headers = {k: v for k, v in stored.headers.items()
               if k.lower() not in ("content-type", "content-length", "x-request-id")}
    if stored.replay_kind == "idempotency":
        headers[REPLAYED_HEADER] = "true"
    if stored.events is not None:
        events = list(stored.events)

        async def replay() -> Any:
            for payload in events:
                yield b"data: " + payload.encode("utf-8") + b"\n\n"

        return EventStreamResponse(replay(), headers=headers)
    return JSONResponse(stored.body, status_code=stored.status, headers=headers)
