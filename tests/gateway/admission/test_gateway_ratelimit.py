"""Per-tenant token buckets, driven by a fake clock."""
from __future__ import annotations

import pytest

from llmserve.gateway.admission.ratelimit import TenantRateLimiter
from llmserve.gateway.config.gateway_config import TenantConfig
from llmserve.gateway.errors import InvalidRequest, RateLimitError
from tests.gateway.race import run_racing


def tenant(name="acme", rpm=None, tpm=None, concurrent=None) -> TenantConfig:
    return TenantConfig(name=name, requests_per_minute=rpm, tokens_per_minute=tpm, max_concurrent=concurrent)


def test_requests_per_minute_then_retry_after_then_recovery(clock):
    limiter = TenantRateLimiter(clock)
    acme = tenant(rpm=3)  # refills one request every 20 s
    for _ in range(3):
        limiter.reserve(acme, 10)
    with pytest.raises(RateLimitError) as info:
        limiter.reserve(acme, 10)
    assert info.value.status == 429
    assert info.value.retry_after == pytest.approx(20.0)
    assert info.value.headers()["Retry-After"] == "20"
    clock.advance(19.9)
    with pytest.raises(RateLimitError) as info:
        limiter.reserve(acme, 10)
    assert info.value.retry_after == pytest.approx(0.1)
    assert info.value.headers()["Retry-After"] == "1"
    clock.advance(0.1)
    limiter.reserve(acme, 10)
    clock.advance(60)  # a full window refills to capacity, not beyond
    for _ in range(3):
        limiter.reserve(acme, 10)
    with pytest.raises(RateLimitError):
        limiter.reserve(acme, 10)


def test_tokens_per_minute_retry_after_is_time_to_refill_the_shortfall(clock):
    limiter = TenantRateLimiter(clock)
    acme = tenant(tpm=600)  # 10 tokens per second
    limiter.reserve(acme, 500)
    with pytest.raises(RateLimitError) as info:
        limiter.reserve(acme, 200)  # 100 available, 100 short
    assert info.value.retry_after == pytest.approx(10.0)
    assert "tokens per minute" in info.value.message
    clock.advance(10.0)
    limiter.reserve(acme, 200)
    assert limiter.remaining(acme) == (None, 0)


def test_rejection_takes_nothing_and_waits_for_the_slower_bucket(clock):
    limiter = TenantRateLimiter(clock)
    acme = tenant(rpm=60, tpm=60)  # one request and one token per second
    limiter.reserve(acme, 60)
    assert limiter.remaining(acme) == (59, 0)
    with pytest.raises(RateLimitError) as info:
        limiter.reserve(acme, 30)
    assert info.value.retry_after == pytest.approx(30.0)
    assert limiter.remaining(acme) == (59, 0)  # the failed attempt took no request


def test_settle_refunds_unused_tokens(clock):
    limiter = TenantRateLimiter(clock)
    acme = tenant(tpm=600)
    reservation = limiter.reserve(acme, 500)
    assert limiter.settle(reservation, 100) == 400
    assert limiter.remaining(acme) == (None, 500)
    assert limiter.settle(reservation, 0) == 0  # settling twice does nothing
    limiter.reserve(acme, 500)


def test_settle_charges_an_overrun(clock):
    limiter = TenantRateLimiter(clock)
    acme = tenant(tpm=600)
    reservation = limiter.reserve(acme, 100)
    assert limiter.settle(reservation, 700) == -600
    with pytest.raises(RateLimitError) as info:
        limiter.reserve(acme, 1)  # level is -100: 101 tokens short
    assert info.value.retry_after == pytest.approx(10.1)


def test_request_larger_than_the_whole_minute_is_400_not_429(clock):
    limiter = TenantRateLimiter(clock)
    with pytest.raises(InvalidRequest) as info:
        limiter.reserve(tenant(tpm=1000), 1001)
    assert info.value.status == 400 and info.value.code == "tokens_per_minute_exceeded"


def test_tenants_have_separate_buckets_and_unlimited_is_unlimited(clock):
    limiter = TenantRateLimiter(clock)
    limiter.reserve(tenant("a", rpm=1), 5)
    limiter.reserve(tenant("b", rpm=1), 5)
    with pytest.raises(RateLimitError):
        limiter.reserve(tenant("a", rpm=1), 5)
    free = tenant("free")
    for _ in range(1000):
        limiter.reserve(free, 10**6)


def test_concurrency_cap_released_by_settle(clock):
    limiter = TenantRateLimiter(clock)
    acme = tenant(concurrent=2)
    first, _ = limiter.reserve(acme, 1), limiter.reserve(acme, 1)
    with pytest.raises(RateLimitError) as info:
        limiter.reserve(acme, 1)
    assert info.value.code == "concurrency_limit_exceeded"
    limiter.settle(first, 1)
    limiter.reserve(acme, 1)


def test_concurrent_reservations_never_exceed_capacity(clock):
    limiter = TenantRateLimiter(clock)
    acme = tenant(rpm=50, tpm=10_000)
    granted, denied = [], []

    def worker(_: int) -> None:
        for _ in range(20):
            try:
                granted.append(limiter.reserve(acme, 100))
            except RateLimitError:
                denied.append(1)

    run_racing(8, worker)
    assert len(granted) == 50 and len(denied) == 160 - 50
    assert limiter.remaining(acme) == (0, 10_000 - 50 * 100)
