"""Live-KV admission and the two-step rate-limit reservation, as units (no server)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from llmserve.gateway import GatewayConfig, InvalidRequest, RateLimitError, TenantRateLimiter, hash_api_key
from llmserve.gateway.admission.kv import KVAdmission, blocks_needed
from llmserve.gateway.admission.ratelimit import estimate_tokens_from_bytes
from llmserve.gateway.errors import KVCachePressureError


@dataclass
class Stats:
    kv_blocks_used: int = 0
    kv_blocks_total: int = 100


class Engine:
    def __init__(self) -> None:
        self.stats = Stats()

    def get_stats(self) -> Stats:
        return self.stats


def test_blocks_needed_counts_the_prompt_once_and_a_partial_block_per_choice() -> None:
    assert blocks_needed(10, 1, 6, 16) == 1 + 1
    assert blocks_needed(30, 2, 20, 16) == 5 + 2       # ceil(70 / 16) + 2


def test_commitments_are_refused_over_the_watermark_and_released(clock) -> None:
    engine = Engine()
    gate = KVAdmission(engine, watermark=0.1, clock=clock)   # limit: 90 of 100 blocks
    big = gate.commit(95)                  # nothing in flight: always admitted
    with pytest.raises(KVCachePressureError) as info:
        gate.commit(1)
    assert info.value.status == 503 and info.value.code == "kv_cache_pressure"
    assert info.value.headers()["Retry-After"] == "1"       # nothing released yet
    big.release()
    big.release()                          # idempotent
    assert gate.committed_blocks == 0
    first = gate.commit(50)
    engine.stats.kv_blocks_used = 85       # the live count wins when it is higher
    with pytest.raises(KVCachePressureError):
        gate.commit(10)
    clock.advance(10)
    first.release()                        # 95 + 50 blocks released over the last 10 s
    gate.commit(1)
    with pytest.raises(KVCachePressureError) as info:
        gate.commit(30)                    # 85 + 30 - 90 = 25 blocks missing
    assert info.value.retry_after == pytest.approx(25 / (145 / 10))


def test_watermark_must_be_a_fraction() -> None:
    with pytest.raises(ValueError):
        KVAdmission(Engine(), watermark=1.0)


def tenant(**fields):
    return GatewayConfig.from_dict({"tenants": {"t": {"keys": [hash_api_key("k")], **fields}}}).tenants["t"]


def test_a_reservation_taken_from_the_size_grows_to_the_real_amount(clock) -> None:
    t = tenant(tokens_per_minute=600)
    limiter = TenantRateLimiter(clock=clock)
    assert estimate_tokens_from_bytes(800) == 100 and estimate_tokens_from_bytes(None) == 0
    r = limiter.reserve(t, estimate_tokens_from_bytes(800))
    limiter.resize(r, 400)                                  # prompt + max_tokens, known now
    assert limiter.remaining(t)[1] == 200
    other = limiter.reserve(t, 150)
    with pytest.raises(RateLimitError):
        limiter.resize(r, 500)                              # 100 more than the 50 left
    with pytest.raises(InvalidRequest):
        limiter.resize(r, 601)                              # more than the whole bucket
    assert r.tokens == 400 and limiter.remaining(t)[1] == 50    # a failed resize changes nothing
    limiter.resize(r, 100)                                  # shrinking refunds at once
    assert limiter.remaining(t)[1] == 350
    limiter.settle(r, 150)
    limiter.settle(other, 150)
    assert limiter.remaining(t)[1] == 300
