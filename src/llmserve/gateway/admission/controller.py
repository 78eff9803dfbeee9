"""Admission control: reject what can never run (400) or cannot wait now (503), before
anything is allocated in the engine.

Per request, in this order:

1. ``check_request(prompt_tokens, max_tokens)`` -- can this request ever run?

   * context:  ``prompt_tokens + max_tokens > max_model_len``  ->  400 ``context_length_exceeded``
   * KV pool:  ``kv_need = ceil((prompt_tokens + max_tokens) / block_size) * block_size``;
     ``kv_need > kv_pool_tokens``  ->  400 ``kv_cache_capacity_exceeded``
     (``kv_pool_tokens = num_kv_blocks * block_size`` of the engine's whole pool).
     With ``n > 1`` each completion is its own sequence; the check is per sequence.

2. ``enter_queue(tokens)`` with ``tokens = prompt_tokens + max_tokens`` (times ``n``)
   -- may it wait now? The queue holds requests that were admitted but not yet started
   by the engine. It overflows when

       queued_requests + 1 > max_queue_requests   or   queued_tokens + tokens > max_queue_tokens

   and the request gets 503 ``server_overloaded`` with ``Retry-After`` (see below). An
   empty queue always takes one request, so any request that passed step 1 can
   eventually be admitted, however large.

3. ``ticket.leave()`` when the engine starts the request (its first scheduling), or when
   it ends without starting (cancelled, failed). A request still queued after
   ``queue_timeout_s`` (``ticket.expired()``) is removed by the caller with
   ``ticket.leave(timed_out=True)`` and answered 503 ``queue_timeout`` (or, when
   streaming already began, a final event with finish_reason ``queue_timeout``).

Retry-After for an overflow is the smaller of

* a bound: every queued request leaves within ``queue_timeout_s`` of entering, so
  enough room is certain once the oldest ``k`` tickets have reached their deadlines,
  where ``k`` is the fewest oldest tickets whose departure makes room; and
* an estimate: the room needed divided by the departure rate (requests/s and tokens/s)
  observed over the last minute,

and the header rounds it up to whole seconds, at least 1.

Fallback: ``would_overload(tokens)`` says whether ``enter_queue`` would reject now. The
HTTP layer may use it to prefer a fallback model, but should still catch
``OverloadedError`` from ``enter_queue`` (another request may take the room in between).

Thread-safe (one lock); the clock (``time.monotonic`` by default) is injectable.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from llmserve.gateway.config.gateway_config import QueueConfig
from llmserve.gateway.errors import ContextLengthExceeded, InvalidRequest, OverloadedError

#: Departures older than this are forgotten by the Retry-After estimate.
RATE_WINDOW_S = 60.0
#: Request header carrying a per-request deadline in seconds.
REQUEST_TIMEOUT_HEADER = "X-Request-Timeout"


def parse_request_timeout(value: Optional[str]) -> Optional[float]:
    """Seconds from an ``X-Request-Timeout`` header value (None when absent).

    Raises InvalidRequest (400) unless it is a finite number > 0. Cap the result with
    ``TenantConfig.effective_timeout(config.request_timeout_s, requested_s)``.
    """
    if value is None or not value.strip():
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        seconds = float("nan")
    if not (seconds > 0 and seconds != float("inf")):
        raise InvalidRequest(f"{REQUEST_TIMEOUT_HEADER} must be a number of seconds > 0, got {value!r}",
                             code="invalid_request_timeout", param=REQUEST_TIMEOUT_HEADER)
    return seconds


def kv_tokens_needed(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV-cache tokens one sequence may need: ``ceil((prompt + max_tokens) / block_size) * block_size``."""
    total = prompt_tokens + max_tokens
    return -(-total // block_size) * block_size


@dataclass(frozen=True)
class AdmissionStats:
    """Counters of one AdmissionController (a consistent snapshot)."""

    queued_requests: int
    queued_tokens: int
    admitted_total: int
    rejected_overload_total: int
    rejected_invalid_total: int
    timed_out_total: int


class QueueTicket:
    """One request's place in the waiting queue. ``leave()`` it exactly once (later calls are no-ops)."""

    def __init__(self, controller: "AdmissionController", tokens: int, entered_at: float) -> None:
        self._controller = controller
        self.tokens = tokens
        self.entered_at = entered_at
        self.deadline = entered_at + controller.queue_timeout_s
        self.left_at: Optional[float] = None

    @property
    def active(self) -> bool:
        """True while the ticket is still in the queue."""
        return self.left_at is None

    def remaining(self, now: Optional[float] = None) -> float:
        """Seconds left before the queue timeout (negative once past it)."""
        now = self._controller._clock() if now is None else now
        return self.deadline - now

    def expired(self, now: Optional[float] = None) -> bool:
        """True once the request has waited ``queue_timeout_s`` or longer."""
        return self.remaining(now) <= 0

    def leave(self, timed_out: bool = False, now: Optional[float] = None) -> float:
        """Leave the queue (started by the engine, ended, or ``timed_out``); returns the time waited."""
        return self._controller._leave(self, timed_out, now)

    def __enter__(self) -> "QueueTicket":
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()


class AdmissionController:
    """Admission for one served model: static checks plus a bounded waiting queue.

    Args:
        max_queue_requests: most requests waiting at once (config ``queue.max_requests``).
        max_queue_tokens: most ``prompt + max_tokens`` summed over waiting requests
            (config ``queue.max_tokens``).
        queue_timeout_s: longest wait in the queue (config ``queue.timeout_s``).
        kv_pool_tokens: tokens the engine's whole KV pool holds (blocks * block_size).
        max_model_len: the model's context length.
        block_size: tokens per KV block.
        clock: monotonic seconds.
    """

    def __init__(self, max_queue_requests: int, max_queue_tokens: int, queue_timeout_s: float,
                 kv_pool_tokens: int, max_model_len: int, block_size: int = 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        for name, value in (("max_queue_requests", max_queue_requests), ("max_queue_tokens", max_queue_tokens),
                            ("kv_pool_tokens", kv_pool_tokens), ("max_model_len", max_model_len),
                            ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {queue_timeout_s!r}")
        self.max_queue_requests = max_queue_requests
        self.max_queue_tokens = max_queue_tokens
        self.queue_timeout_s = float(queue_timeout_s)
        self.kv_pool_tokens = kv_pool_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self._clock = clock
        self._lock = threading.Lock()
        self._tickets: dict[int, QueueTicket] = {}  # insertion order = entry order = deadline order
        self._queued_tokens = 0
        self._departures: collections.deque[tuple[float, int]] = collections.deque()
        self._admitted = self._rejected_overload = self._rejected_invalid = self._timed_out = 0

    @classmethod
    def from_config(cls, queue: QueueConfig, *, kv_pool_tokens: int, max_model_len: int,
                    block_size: int, clock: Callable[[], float] = time.monotonic) -> "AdmissionController":
        """Build from the gateway config's ``queue`` section and the engine's sizes."""
        return cls(queue.max_requests, queue.max_tokens, queue.timeout_s, kv_pool_tokens,
                   max_model_len, block_size, clock)

    # ------------------------------------------------------------------ static checks

    def check_request(self, prompt_tokens: int, max_tokens: int) -> int:
        """Raise 400 for a request that can never run; return its KV need in tokens.

        Raises:
            ContextLengthExceeded: ``prompt_tokens + max_tokens > max_model_len``.
            InvalidRequest (code ``kv_cache_capacity_exceeded``):
                ``ceil((prompt_tokens + max_tokens) / block_size) * block_size > kv_pool_tokens``.
        """
        if prompt_tokens < 0 or max_tokens < 0:   # 0: an embedding (prefill only)
            raise ValueError(f"need prompt_tokens >= 0 and max_tokens >= 0, got {prompt_tokens}, {max_tokens}")
        total = prompt_tokens + max_tokens
        if total > self.max_model_len:
            self._count_invalid()
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or max_tokens.",
                param="max_tokens" if prompt_tokens < self.max_model_len else None,
            )
        need = kv_tokens_needed(prompt_tokens, max_tokens, self.block_size)
        if need > self.kv_pool_tokens:
            self._count_invalid()
            raise InvalidRequest(
                f"This request needs up to {need} tokens of KV cache (prompt {prompt_tokens} + "
                f"max_tokens {max_tokens}, rounded up to whole blocks of {self.block_size}), but the "
                f"server's entire KV cache holds {self.kv_pool_tokens} tokens, so it can never run. "
                "Please reduce the prompt or max_tokens.",
                code="kv_cache_capacity_exceeded", param="max_tokens",
            )
        return need

    def _count_invalid(self) -> None:
        with self._lock:
            self._rejected_invalid += 1

    # ------------------------------------------------------------------ the queue

    def _overflows(self, tokens: int) -> bool:
        if not self._tickets:
            return False
        return (len(self._tickets) + 1 > self.max_queue_requests
                or self._queued_tokens + tokens > self.max_queue_tokens)

    def would_overload(self, tokens: int) -> bool:
        """True when ``enter_queue(tokens)`` would be rejected right now."""
        with self._lock:
            return self._overflows(tokens)

    def enter_queue(self, tokens: int, now: Optional[float] = None) -> QueueTicket:
        """Take a place in the waiting queue for a request of ``tokens`` (prompt + max_tokens).

        Raises:
            OverloadedError (503): the queue is full by count or by tokens; ``retry_after``
                is the estimate described in the module docstring.
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        with self._lock:
            now = self._clock() if now is None else now
            if self._overflows(tokens):
                self._rejected_overload += 1
                wait = self._estimate_wait(tokens, now)
                raise OverloadedError(
                    f"The server is overloaded ({len(self._tickets)} requests and {self._queued_tokens} "
                    "tokens waiting); please retry later",
                    wait,
                )
            ticket = QueueTicket(self, tokens, now)
            self._tickets[id(ticket)] = ticket
            self._queued_tokens += tokens
            self._admitted += 1
            return ticket

    def _leave(self, ticket: QueueTicket, timed_out: bool, now: Optional[float]) -> float:
        with self._lock:
            if ticket.left_at is not None:
                return ticket.left_at - ticket.entered_at
            now = self._clock() if now is None else now
            ticket.left_at = now
            del self._tickets[id(ticket)]
            self._queued_tokens -= ticket.tokens
            self._departures.append((now, ticket.tokens))
            self._forget_old_departures(now)
            self._timed_out += int(timed_out)
            return now - ticket.entered_at

    def _estimate_wait(self, tokens: int, now: float) -> float:
        """Seconds until ``tokens`` fit (called with the lock held); see the module docstring."""
        need_count = len(self._tickets) + 1 - self.max_queue_requests
        need_tokens = self._queued_tokens + tokens - self.max_queue_tokens
        bound = self.queue_timeout_s
        freed_count = freed_tokens = 0
        for ticket in self._tickets.values():  # oldest first
            freed_count += 1
            freed_tokens += ticket.tokens
            if freed_count >= need_count and (freed_tokens >= need_tokens or freed_count == len(self._tickets)):
                bound = max(0.0, ticket.deadline - now)
                break
        self._forget_old_departures(now)
        if not self._departures:
            return bound
        span = max(now - self._departures[0][0], 1.0)
        estimates = []
        if need_count > 0:
            estimates.append(need_count / (len(self._departures) / span))
        departed_tokens = sum(t for _, t in self._departures)
        if need_tokens > 0 and departed_tokens > 0:
            estimates.append(need_tokens / (departed_tokens / span))
        return min(bound, max(estimates)) if estimates else bound

    def _forget_old_departures(self, now: float) -> None:
        while self._departures and self._departures[0][0] < now - RATE_WINDOW_S:
            self._departures.popleft()

    def stats(self) -> AdmissionStats:
        """A snapshot of the queue and the counters."""
        with self._lock:
            return AdmissionStats(len(self._tickets), self._queued_tokens, self._admitted,
                                  self._rejected_overload, self._rejected_invalid, self._timed_out)
