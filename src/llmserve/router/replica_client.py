"""Client of one engine process (``llmserve engine``) for the router: no torch.

``ReplicaClient.generate`` streams ``RequestOutput`` increments over HTTP and maps the
engine's error events back to the exceptions an in-process engine raises (ValueError,
RequestFailedError). Anything that says the *replica* cannot serve (refused or broken
connection, 5xx, an ``engine`` error event, the replica ejected while the stream is
quiet) raises :class:`ReplicaUnavailable`, which the router may retry elsewhere when
nothing was streamed yet.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncGenerator, Callable, Optional

import httpx

from llmserve.protocol import EngineStats, RequestOutput
from llmserve.router.wire import (
    WIRE_VERSION,
    error_from_event,
    output_from_dict,
    params_to_dict,
    stats_from_dict,
    tokenizer_from_dict,
)
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_END = object()


class ReplicaUnavailable(RuntimeError):
    """The replica could not run (or finish) the request: its process is gone, it refused
    the connection, the stream broke, or it was ejected."""


class ReplicaClient:
    """HTTP client of one engine replica at ``base_url``."""

    def __init__(self, base_url: str, token: Optional[str] = None,
                 connect_timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = httpx.Timeout(connect=connect_timeout_s, read=None, write=30.0,
                                      pool=connect_timeout_s)
        self._client: Optional[httpx.AsyncClient] = None
        self._client_loop: Optional[asyncio.AbstractEventLoop] = None

    # ---- synchronous calls (start-up and the health thread) ------------------------------
    def fetch_info(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The replica's model name, fingerprint, context length, block size and tokenizer
        (``tokenizer`` is rebuilt into a Tokenizer)."""
        r = httpx.get(self.base_url + "/internal/v1/info", headers=self._headers,
                      timeout=timeout_s)
        r.raise_for_status()
        info = r.json()
        if info.get("wire_version") != WIRE_VERSION:
            raise ValueError(f"replica {self.base_url} speaks wire version "
                             f"{info.get('wire_version')}, this router {WIRE_VERSION}")
        info["tokenizer"] = tokenizer_from_dict(info["tokenizer"])
        return info

    def fetch_status(self, client: httpx.Client) -> tuple[bool, EngineStats, int]:
        """(ready, stats, requests in flight); raises httpx.HTTPError when unreachable."""
        r = client.get(self.base_url + "/internal/v1/status", headers=self._headers)
        r.raise_for_status()
        data = r.json()
        return bool(data["ready"]), stats_from_dict(data["stats"]), int(data["in_flight"])

    # ---- asynchronous calls (the server's event loop) ------------------------------------
    def _async_client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(timeout=self._timeout,
                                             limits=httpx.Limits(max_connections=None,
                                                                 max_keepalive_connections=64))
            self._client_loop = loop
        return self._client

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str, *,
                       is_healthy: Callable[[], bool], priority: Any = None,
                       cache_salt: Optional[str] = None, deadline: Optional[float] = None,
                       queue_deadline: Optional[float] = None,
                       prediction: Optional[str] = None,
                       check_every_s: float = 0.5) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's increments; ``is_healthy`` is checked while the stream is
        quiet, so a replica ejected by the health checker fails its streams at once."""
        body = {"request_id": request_id, "prompt": list(prompt),
                "params": params_to_dict(params), "priority": priority,
                "cache_salt": cache_salt, "deadline": deadline, "queue_deadline": queue_deadline,
                "prediction": prediction}
        prompt_ids = body["prompt"]   # increments arrive without their prompt
        lines: asyncio.Queue = asyncio.Queue()
        reader = asyncio.ensure_future(self._read_lines(body, lines))
        try:
            while True:
                try:
                    item = await asyncio.wait_for(lines.get(), check_every_s)
                except asyncio.TimeoutError:
                    if not is_healthy():
                        raise ReplicaUnavailable(f"replica {self.base_url} was ejected "
                                                 "while the request ran") from None
                    continue
                if item is _END:
                    raise ReplicaUnavailable(f"replica {self.base_url} ended the stream "
                                             "without a final output")
                if isinstance(item, BaseException):
                    raise item
                event = json.loads(item)
                if "error" in event:
                    raise _error_from_event(event["error"], self.base_url)
                out = output_from_dict(event["output"], prompt_ids)
                yield out
                if out.finished:
                    return
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read_lines(self, body: dict, lines: asyncio.Queue) -> None:
        try:
            async with self._async_client().stream(
                    "POST", self.base_url + "/internal/v1/generate", json=body,
                    headers=self._headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:500]
                    err: BaseException = (ReplicaUnavailable if resp.status_code >= 500
                                          else RuntimeError)(
                        f"replica {self.base_url} answered {resp.status_code}: {text}")
                    lines.put_nowait(err)
                    return
                async for line in resp.aiter_lines():
                    if line.strip():
                        lines.put_nowait(line)
            lines.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, OSError) as exc:
            lines.put_nowait(ReplicaUnavailable(f"replica {self.base_url}: {exc!r}"))

    async def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Abort ``request_id`` there; its final output (for billing) or None."""
        try:
            r = await self._async_client().post(self.base_url + "/internal/v1/abort",
                                                json={"request_id": request_id},
                                                headers=self._headers, timeout=10.0)
            r.raise_for_status()
        except (httpx.HTTPError, OSError) as exc:
            logger.warning("abort of %s on %s failed: %r", request_id, self.base_url, exc)
            return None
        data = r.json().get("output")
        return output_from_dict(data) if data else None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _error_from_event(err: dict, base_url: str) -> BaseException:
    return error_from_event(err, ReplicaUnavailable(
        f"replica {base_url}: {err.get('message', 'engine error')}"))