"""Async load generator: streams requests to any OpenAI-compatible server and times them.

Every request is sent with ``stream=true`` and ``stream_options={"include_usage": true}``
to ``/v1/completions`` (``endpoint="completions"``) or ``/v1/chat/completions``
(``endpoint="chat"``). Arrivals follow a Poisson process at ``request_rate`` requests/s
(``inf``: all at once), capped at ``max_concurrency`` requests in flight. A chat turn is
not sent before the previous turn of its conversation finished. In the ``multi-turn``
workload (chat endpoint) a turn's messages are the previous turn's messages, the
server's actual answer to it, and the turn's new user message.

What counts as an arrival, how tokens are counted and what makes a request fail is
defined in :mod:`llmserve.bench.metrics`. Timestamps are taken when a TCP chunk is read,
so several SSE events in one chunk share a timestamp (their ITL gap is 0).
"""
from __future__ import annotations

import asyncio
import codecs
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TextIO

import httpx

from llmserve.bench.metrics import RequestRecord
from llmserve.bench.workloads import RequestSpec

logger = logging.getLogger(__name__)

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class SSEParser:
    """Incremental Server-Sent Events parser; returns each complete event's ``data``.

    Handles events split across reads, several events per read, CRLF or LF line ends,
    multi-line ``data:`` fields, comments and UTF-8 characters split across reads.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""

    def feed(self, chunk: bytes) -> list[str]:
        text = self._buf + self._decoder.decode(chunk)
        hold_cr = text.endswith("\r")  # may be the first half of a CRLF
        if hold_cr:
            text = text[:-1]
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        events = text.split("\n\n")
        self._buf = events.pop() + ("\r" if hold_cr else "")
        return [d for d in (self._data_of(e) for e in events) if d is not None]

    def flush(self) -> list[str]:
        """Data of a final event not followed by a blank line (end of body)."""
        text = (self._buf + self._decoder.decode(b"", final=True)).replace("\r", "")
        self._buf = ""
        data = self._data_of(text)
        return [data] if data is not None else []

    @staticmethod
    def _data_of(event: str) -> Optional[str]:
        lines = []
        for line in event.split("\n"):
            if line.startswith("data:"):
                value = line[5:]
                lines.append(value[1:] if value.startswith(" ") else value)
        return "\n".join(lines) if lines else None


def build_payload(spec: RequestSpec, model: str, endpoint: str, *, ignore_eos: bool = True,
                  temperature: float = 0.0, extra_body: Optional[dict] = None) -> dict:
    """The JSON body for one request.

    With ``ignore_eos`` the body asks for exactly ``spec.output_len`` tokens (``ignore_eos``,
    ``max_tokens`` and ``min_tokens``); servers that lack those fields simply ignore them.
    """
    if endpoint not in ENDPOINT_PATHS:
        raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, got {endpoint!r}")
    body: dict = {"model": model, "max_tokens": spec.output_len, "temperature": temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    if ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = spec.output_len
    body.update(spec.extra)   # per-request fields of the workload (e.g. response_format)
    body.update(extra_body or {})
    return body


def poisson_arrival_offsets(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send offsets (s) of ``n`` requests: 0 then exponential gaps of mean 1/rate; inf: all 0."""
    if request_rate <= 0 or math.isnan(request_rate):
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(request_rate)
        offsets.append(t)
    return offsets


def _content_of(choice: dict) -> str:
    if choice.get("text"):
        return choice["text"]
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or ""


async def _send_streaming(client: httpx.AsyncClient, url: str, payload: dict,
                          record: RequestRecord) -> httpx.Response:
    """POST ``payload`` and return the response once its headers are in (body unread).

    A server may close an idle keep-alive connection just as the client reuses it
    (llama-server's HTTP library does after 5 s); the POST then fails with "Server
    disconnected without sending a response". That race is the client's, not a failed
    request, so the POST is sent once more (the dead connection is dropped from the pool;
    the time it cost stays in TTFT). A second failure counts as a connection error.
    """
    try:
        return await client.send(client.build_request("POST", url, json=payload), stream=True)
    except httpx.RemoteProtocolError as exc:
        logger.info("request %s: %r on a reused connection; sending it again",
                    record.request_id, exc)
        return await client.send(client.build_request("POST", url, json=payload), stream=True)


async def stream_one(client: httpx.AsyncClient, url: str, payload: dict,
                     record: RequestRecord) -> None:
    """Send one streaming request and fill ``record`` (times relative to its send time)."""
    record.send_time = time.perf_counter()
    saw_done = saw_finish = False
    try:
        resp = await _send_streaming(client, url, payload, record)
        try:
            if resp.status_code >= 400:
                body = await resp.aread()
                record.error = str(resp.status_code)
                record.error_detail = body.decode("utf-8", "replace")
                return
            parser = SSEParser()
            async for chunk in resp.aiter_bytes():
                now = time.perf_counter() - record.send_time
                for data in parser.feed(chunk):
                    done, finish = _apply_event(data, now, record)
                    saw_done, saw_finish = saw_done or done, saw_finish or finish
            now = time.perf_counter() - record.send_time
            for data in parser.flush():
                done, finish = _apply_event(data, now, record)
                saw_done, saw_finish = saw_done or done, saw_finish or finish
        finally:
            await resp.aclose()
        if record.error is None and not (saw_done or saw_finish):
            record.error = "incomplete_stream"
            record.error_detail = "stream ended without [DONE] or a finish_reason"
    except httpx.TimeoutException as exc:
        record.error, record.error_detail = "timeout", repr(exc)
    except (httpx.TransportError, httpx.StreamError) as exc:
        record.error, record.error_detail = "connection", repr(exc)
    except Exception as exc:  # a bug or an odd server must not stop the whole run
        logger.exception("request %s failed in the client", record.request_id)
        record.error, record.error_detail = "client_error", repr(exc)
    finally:
        record.end_time = time.perf_counter() - record.send_time
        record.success = record.error is None


def _apply_event(data: str, now: float, record: RequestRecord) -> tuple[bool, bool]:
    """Update ``record`` from one event's data; returns (is ``[DONE]``, has a finish_reason)."""
    if data.strip() == "[DONE]":
        return True, False
    if record.error is not None:
        return False, False
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        record.error, record.error_detail = "stream_error", f"bad event data: {data[:200]}"
        return False, False
    if not isinstance(obj, dict) or "error" in obj:
        record.error, record.error_detail = "stream_error", data[:300]
        return False, False
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            record.usage_completion_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            record.usage_prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.usage_cached_tokens = details["cached_tokens"]
    choices = [c for c in obj.get("choices") or [] if isinstance(c, dict)]
    texts = [_content_of(c) for c in choices]
    if any(texts):
        record.arrival_times.append(now)
        record.reply_text.extend(t for t in texts if t)
    finishes = [c["finish_reason"] for c in choices if c.get("finish_reason")]
    if finishes:
        record.finish_reason = finishes[0]
    return False, bool(finishes)


class ProgressBar:
    """A one-line progress bar on a stream (redrawn in place on a TTY, else every 10%)."""

    def __init__(self, total: int, label: str = "", stream: Optional[TextIO] = None,
                 enabled: bool = True) -> None:
        self.total, self.label, self.enabled = total, label, enabled and total > 0
        self.stream = stream if stream is not None else sys.stderr
        self.done = self.failed = 0
        self._t0 = time.perf_counter()
        self._last_draw = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if not self.enabled:
            return
        now = time.perf_counter()
        step = max(1, self.total // 10)
        if self.done == self.total or (self._tty and now - self._last_draw > 0.1) or (
                not self._tty and self.done % step == 0):
            self._last_draw = now
            self.stream.write(("\r" if self._tty else "") + self.render(now - self._t0)
                              + ("" if self._tty and self.done < self.total else "\n"))
            self.stream.flush()

    def render(self, elapsed: float) -> str:
        width = 30
        filled = width * self.done // max(self.total, 1)
        return (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
                f" failed={self.failed} {elapsed:6.1f}s")


@dataclass
class LoadResult:
    """Records of one run (in the order of the specs) and its wall-clock duration."""

    records: list[RequestRecord]
    duration_s: float
    started_at: float          # time.time() at the start
    model: str
    endpoint: str


async def fetch_model_name(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id listed at /v1/models ("default" when that fails)."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
        logger.warning("could not read the model name from /v1/models (%s); using 'default'",
                       exc)
        return "default"


async def run_load(base_url: str, specs: Sequence[RequestSpec], *, model: Optional[str] = None,
                   endpoint: str = "completions", request_rate: float = math.inf,
                   max_concurrency: Optional[int] = None, seed: int = 0, ignore_eos: bool = True,
                   temperature: float = 0.0, extra_body: Optional[dict] = None,
                   request_timeout_s: float = 600.0, progress: bool = True,
                   label: str = "", on_done: Optional[Callable[[RequestRecord], None]] = None
                   ) -> LoadResult:
    """Send every spec and return the records (see module docstring for the schedule)."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    url = base_url.rstrip("/") + ENDPOINT_PATHS.get(endpoint, "")
    offsets = poisson_arrival_offsets(len(specs), request_rate, seed)
    pool = max_concurrency or max(len(specs), 1)
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    timeout = httpx.Timeout(request_timeout_s, connect=min(30.0, request_timeout_s))
    sem = asyncio.Semaphore(pool)
    bar = ProgressBar(len(specs), label or endpoint, enabled=progress)
    turn_done = {(s.conversation_id, s.turn): asyncio.Event() for s in specs
                 if s.conversation_id is not None}
    records = [RequestRecord(s.request_id, s.input_len, expected_output_len=s.output_len,
                             conversation_id=s.conversation_id, turn=s.turn) for s in specs]
    # trust_env=False: never route loopback benchmark traffic through an HTTP(S)_PROXY
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = model or await fetch_model_name(client, base_url)
        payloads = [build_payload(s, model, endpoint, ignore_eos=ignore_eos,
                                  temperature=temperature, extra_body=extra_body) for s in specs]

        history: dict[Optional[int], list[dict]] = {}   # multi-turn: the real conversation

        async def one(i: int) -> None:
            spec, record = specs[i], records[i]
            try:
                prev = turn_done.get((spec.conversation_id, (spec.turn or 0) - 1))
                if prev is not None:
                    await prev.wait()
                if spec.meta.get("follow_up") and endpoint == "chat":
                    payloads[i] = dict(payloads[i], messages=history.get(
                        spec.conversation_id, []) + list(spec.messages))
                async with sem:
                    try:
                        await asyncio.wait_for(stream_one(client, url, payloads[i], record),
                                               request_timeout_s)
                    except asyncio.TimeoutError:
                        record.success, record.error = False, "timeout"
                        record.end_time = time.perf_counter() - record.send_time
                if spec.meta.get("follow_up") is not None and endpoint == "chat":
                    history[spec.conversation_id] = list(payloads[i]["messages"]) + [
                        {"role": "assistant", "content": "".join(record.reply_text)}]
            finally:
                event = turn_done.get((spec.conversation_id, spec.turn))
                if event is not None:
                    event.set()
                bar.update(record.success)
                if on_done is not None:
                    on_done(record)

        started_at = time.time()
        start = time.perf_counter()
        tasks = []
        for i, offset in enumerate(offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    for r in records:  # make send times relative to the run's start
        r.send_time -= start
    return LoadResult(records, max(duration, 1e-9), started_at, model, endpoint)
