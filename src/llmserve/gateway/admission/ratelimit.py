"""Per-tenant rate limits: token buckets for requests and tokens per minute.

Each limited tenant has up to two buckets. A bucket holds at most ``capacity`` units
(the per-minute amount, or the tenant's ``request_burst`` / ``token_burst`` when set)
and refills continuously at ``per_minute / 60`` units per second, so a tenant may
burst a whole bucket and then sustain the per-minute rate.

Lifecycle of one request::

    reservation = limiter.reserve(tenant, prompt_tokens + max_tokens)   # may raise 429 / 400
    try:
        ... run it ...
    finally:
        limiter.settle(reservation, actual_prompt_tokens + completion_tokens)

``reserve`` takes one request and the worst-case token count atomically (both or
neither); ``settle`` refunds the unused tokens (or charges the overrun) and releases
the tenant's concurrency slot. Settle every reservation exactly once; a second call is
ignored. A request that was rejected after reserving (e.g. 503 at admission) is settled
with the tokens it cost (the gateway charges the prompt tokens it tokenized, 0 before
that): the rest come back, the request still counts against the rpm.

A reservation can be taken early, before the body is parsed, for a lower-bound
estimate (see ``estimate_tokens_from_bytes``), and grown later to the real amount with
``resize`` -- so a tenant whose budget is spent is refused before any parsing or
tokenization, and concurrent large requests each take their share at once.

Thread-safe (one lock); the clock is injectable for tests.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from llmserve.gateway.config.gateway_config import TenantConfig
from llmserve.gateway.errors import InvalidRequest, RateLimitError

#: Retry-After for a tenant at its concurrency cap (when one of its requests ends is unknown).
CONCURRENCY_RETRY_AFTER_S = 1.0
#: Body bytes per token of the early estimate: a lower bound for ordinary text (English
#: averages ~4 bytes per token and JSON adds quotes), so honest requests are not refused
#: on the estimate; the exact count is charged once the prompt is tokenized.
BYTES_PER_TOKEN_ESTIMATE = 8


def estimate_tokens_from_bytes(body_bytes: "int | None") -> int:
    """A conservative (low) estimate of the prompt tokens in a request body of this size."""
    if not body_bytes or body_bytes < 0:
        return 0
    return body_bytes // BYTES_PER_TOKEN_ESTIMATE


class TokenBucket:
    """A bucket of ``capacity`` units refilled at ``rate`` units per second (default
    ``capacity / period_s``).

    The level may go negative when a settled request used more than it reserved; the
    debt is paid off by the refill before anything else is admitted. Not locked: the
    owner serializes access.
    """

    def __init__(self, capacity: int, now: float, period_s: float = 60.0,
                 rate: Optional[float] = None) -> None:
        if capacity < 1:
            raise ValueError(f"bucket capacity must be >= 1, got {capacity}")
        if rate is not None and not rate > 0:
            raise ValueError(f"bucket rate must be > 0, got {rate}")
        self.capacity = float(capacity)
        self.rate = capacity / period_s if rate is None else float(rate)
        self.level = float(capacity)
        self.updated = now

    def refill(self, now: float) -> None:
        """Add what accrued since the last update, up to the capacity."""
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_time(self, amount: float) -> float:
        """Seconds until ``amount`` units are available (0 if they are now); refill first."""
        missing = amount - self.level
        return 0.0 if missing <= 1e-9 else missing / self.rate

    def take(self, amount: float) -> None:
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


def _too_many_tokens(tokens: int, bucket: TokenBucket) -> InvalidRequest:
    return InvalidRequest(
        f"This request needs up to {tokens} tokens (prompt + max_tokens), more than "
        f"the {int(bucket.capacity)} tokens per minute the tenant's token bucket holds; "
        "reduce max_tokens or the prompt",
        code="tokens_per_minute_exceeded", param="max_tokens",
    )


@dataclass
class Reservation:
    """What ``reserve`` took for one request; pass it to ``settle`` when the request ends."""

    tenant: str
    tokens: int
    created_at: float
    settled: bool = field(default=False, compare=False)


@dataclass
class _TenantState:
    requests: Optional[TokenBucket]
    tokens: Optional[TokenBucket]
    max_concurrent: Optional[int]
    in_flight: int = 0


class TenantRateLimiter:
    """Token-bucket rate limits (rpm, tpm) and an optional concurrency cap per tenant.

    Buckets are created on a tenant's first request from its ``TenantConfig``
    (``requests_per_minute``, ``tokens_per_minute``, ``max_concurrent``; None means
    unlimited) and kept by tenant name.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._states: dict[str, _TenantState] = {}

    def _state(self, tenant: TenantConfig, now: float) -> _TenantState:
        state = self._states.get(tenant.name)
        if state is None:
            rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
            state = _TenantState(
                requests=TokenBucket(tenant.request_burst or rpm, now, rate=rpm / 60.0) if rpm else None,
                tokens=TokenBucket(tenant.token_burst or tpm, now, rate=tpm / 60.0) if tpm else None,
                max_concurrent=tenant.max_concurrent,
            )
            self._states[tenant.name] = state
        return state

    def reserve(self, tenant: TenantConfig, tokens: int, now: Optional[float] = None) -> Reservation:
        """Take one request and ``tokens`` tokens from the tenant's buckets.

        Args:
            tenant: the authenticated tenant.
            tokens: the worst case, prompt tokens + max_tokens.
            now: the clock reading (tests); default: the limiter's clock.

        Raises:
            InvalidRequest (400): ``tokens`` exceeds the tenant's whole tokens_per_minute,
                so waiting can never help.
            RateLimitError (429): not enough requests or tokens left now; ``retry_after``
                is the time until both buckets hold enough (nothing is taken).
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be a non-negative integer, got {tokens!r}")
        with self._lock:
            now = self._clock() if now is None else now
            state = self._state(tenant, now)
            if state.tokens is not None and tokens > state.tokens.capacity:
                raise _too_many_tokens(tokens, state.tokens)
            if state.max_concurrent is not None and state.in_flight >= state.max_concurrent:
                raise RateLimitError(
                    f"Too many concurrent requests for tenant {tenant.name!r} "
                    f"(limit {state.max_concurrent})",
                    CONCURRENCY_RETRY_AFTER_S, code="concurrency_limit_exceeded",
                )
            waits = {}
            for kind, bucket, amount in (("requests", state.requests, 1), ("tokens", state.tokens, tokens)):
                if bucket is not None:
                    bucket.refill(now)
                    wait = bucket.wait_time(amount)
                    if wait > 0:
                        waits[kind] = wait
            if waits:
                kinds = " and ".join(f"{kind} per minute" for kind in waits)
                raise RateLimitError(
                    f"Rate limit reached for tenant {tenant.name!r} ({kinds}); "
                    f"retry in {max(waits.values()):.1f}s",
                    max(waits.values()),
                )
            if state.requests is not None:
                state.requests.take(1)
            if state.tokens is not None:
                state.tokens.take(tokens)
            state.in_flight += 1
            return Reservation(tenant=tenant.name, tokens=tokens, created_at=now)

    def resize(self, reservation: Reservation, tokens: int, now: Optional[float] = None) -> None:
        """Grow (or shrink) a reservation to ``tokens`` tokens, e.g. from the early size
        estimate to prompt + max_tokens once the prompt is tokenized.

        Raises (and changes nothing):
            InvalidRequest (400): ``tokens`` exceeds the tenant's whole token bucket.
            RateLimitError (429): the extra tokens are not available now.
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be a non-negative integer, got {tokens!r}")
        with self._lock:
            state = self._states.get(reservation.tenant)
            if reservation.settled or state is None or state.tokens is None:
                reservation.tokens = tokens
                return
            bucket = state.tokens
            if tokens > bucket.capacity:
                raise _too_many_tokens(tokens, bucket)
            extra = tokens - reservation.tokens
            bucket.refill(self._clock() if now is None else now)
            if extra > 0:
                wait = bucket.wait_time(extra)
                if wait > 0:
                    raise RateLimitError(
                        f"Rate limit reached for tenant {reservation.tenant!r} (tokens per "
                        f"minute); retry in {wait:.1f}s", wait)
                bucket.take(extra)
            else:
                bucket.give_back(-extra)
            reservation.tokens = tokens

    def settle(self, reservation: Reservation, actual_tokens: int, now: Optional[float] = None) -> int:
        """Settle a reservation to the tokens actually used and free its concurrency slot.

        Refunds ``reserved - actual`` tokens (or charges the overrun when ``actual``
        is larger). Returns the tokens refunded (negative for a charge); 0 when the
        reservation was already settled.
        """
        if actual_tokens < 0:
            raise ValueError(f"actual_tokens must be >= 0, got {actual_tokens}")
        with self._lock:
            if reservation.settled:
                return 0
            reservation.settled = True
            state = self._states.get(reservation.tenant)
            if state is None:  # limiter was replaced; nothing to settle
                return 0
            state.in_flight = max(0, state.in_flight - 1)
            refund = reservation.tokens - actual_tokens
            if state.tokens is not None:
                state.tokens.refill(self._clock() if now is None else now)
                if refund >= 0:
                    state.tokens.give_back(refund)
                else:
                    state.tokens.take(-refund)
            return refund

    def remaining(self, tenant: TenantConfig, now: Optional[float] = None) -> tuple[Optional[int], Optional[int]]:
        """(requests, tokens) available to the tenant now, None for an unlimited one.

        Meant for informational headers such as ``x-ratelimit-remaining-tokens``.
        """
        with self._lock:
            now = self._clock() if now is None else now
            state = self._state(tenant, now)
            out: list[Optional[int]] = []
            for bucket in (state.requests, state.tokens):
                if bucket is None:
                    out.append(None)
                else:
                    bucket.refill(now)
                    out.append(max(0, int(bucket.level)))
            return out[0], out[1]
