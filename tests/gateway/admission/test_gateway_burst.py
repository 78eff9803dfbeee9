"""request_burst / token_burst: a bucket smaller than a minute's allowance, same refill rate."""
from __future__ import annotations

import pytest

from llmserve.gateway import GatewayConfig, RateLimitError, TenantRateLimiter, hash_api_key
from llmserve.gateway.errors import InvalidRequest


def tenant_config(**fields):
    data = {"tenants": {"t": {"keys": [hash_api_key("k")], **fields}}}
    return GatewayConfig.from_dict(data).tenants["t"]


def test_burst_fields_parse_and_need_their_rate() -> None:
    t = tenant_config(requests_per_minute=60, request_burst=2, tokens_per_minute=600, token_burst=50)
    assert (t.request_burst, t.token_burst) == (2, 50)
    with pytest.raises(ValueError, match="tenants.t.request_burst: only meaningful"):
        tenant_config(request_burst=2)
    with pytest.raises(ValueError, match="tenants.t.token_burst: only meaningful"):
        tenant_config(token_burst=5)
    with pytest.raises(ValueError, match="tenants.t.request_burst: must be at least 1"):
        tenant_config(requests_per_minute=60, request_burst=0)


def test_request_burst_caps_the_bucket_and_refills_at_the_per_minute_rate(clock) -> None:
    tenant = tenant_config(requests_per_minute=60, request_burst=2)
    limiter = TenantRateLimiter(clock=clock)
    for _ in range(2):
        limiter.settle(limiter.reserve(tenant, 1), 1)
    with pytest.raises(RateLimitError) as info:
        limiter.reserve(tenant, 1)
    assert info.value.headers()["Retry-After"] == "1"   # 60 rpm: one per second
    clock.advance(1.0)
    limiter.settle(limiter.reserve(tenant, 1), 1)
    clock.advance(3600)                                   # idle for long: still at most 2
    assert limiter.remaining(tenant)[0] == 2


def test_token_burst_is_the_largest_request_that_can_ever_pass(clock) -> None:
    tenant = tenant_config(tokens_per_minute=6000, token_burst=100)
    limiter = TenantRateLimiter(clock=clock)
    with pytest.raises(InvalidRequest) as info:
        limiter.reserve(tenant, 101)
    assert info.value.code == "tokens_per_minute_exceeded"
    r = limiter.reserve(tenant, 100)
    with pytest.raises(RateLimitError) as info:
        limiter.reserve(tenant, 10)
    assert info.value.retry_after == pytest.approx(0.1)  # 100 tokens/s
    limiter.settle(r, 40)                                 # refund 60
    limiter.settle(limiter.reserve(tenant, 50), 50)
