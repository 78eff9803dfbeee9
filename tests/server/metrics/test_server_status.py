"""`GET /v1/status` (server/metrics/status.py): quantiles from histogram buckets, the window's
baseline, rates, and the status endpoint of a live server over the fake engine."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from llmserve.server.metrics.status import StatusSampler, histogram_quantile, parse_window
from tests.server.server_helpers import chat_body


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (float("inf"), 40.0)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1 * 10 / 10)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (39.6 - 30) / 10)
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert histogram_quantile(0.99, [(0.1, 1.0), (float("inf"), 5.0)]) == 0.1  # +Inf bucket


@pytest.mark.parametrize("raw,expected", [(None, 300.0), ("", 300.0), ("60", 60.0)])
def test_parse_window(raw, expected) -> None:
    assert parse_window(raw) == expected


@pytest.mark.parametrize("raw", ["5", "1801", "nan", "abc", "-10"])
def test_parse_window_rejects(raw) -> None:
    with pytest.raises(Exception) as err:
        parse_window(raw)
    assert getattr(err.value, "status", None) == 400


def test_window_counts_from_the_newest_sample_before_its_start() -> None:
    reg = CollectorRegistry()
    tokens = Counter("llmserve_generation_tokens", "t", registry=reg)
    ttft = Histogram("llmserve_time_to_first_token_seconds", "t", buckets=(0.1, 1.0),
                     registry=reg)
    now = [1000.0]
    sampler = StatusSampler(reg, clock=lambda: now[0], wall_clock=lambda: now[0])
    ttft.observe(5.0)                     # before the window: must not count in it
    tokens.inc(100)
    now[0] += 100
    asyncio.run(sampler.sample())         # t=1100
    tokens.inc(50)
    ttft.observe(0.05)
    now[0] += 10                          # t=1110, window 10 s: baseline is t=1100
    body = asyncio.run(sampler.snapshot(window=10))
    assert body["window_s"] == 10
    assert body["window"]["generation_tokens_per_s"] == pytest.approx(5.0)
    assert body["latency"]["ttft"]["count"] == 1
    assert body["latency"]["ttft"]["p99"] == pytest.approx(0.099)
    assert body["totals"]["generation_tokens"] == 150
    wide = asyncio.run(sampler.snapshot(window=300))   # reaches the startup reading
    assert wide["window_s"] == 110 and wide["latency"]["ttft"]["count"] == 2
    assert [p["t"] for p in wide["series"]][0] == 1000


def test_status_endpoint_over_the_fake_engine(fake_server) -> None:
    r = httpx.post(fake_server.url("/v1/chat/completions"), json=chat_body(max_tokens=4),
                   timeout=30)
    assert r.status_code == 200
    body = httpx.get(fake_server.url("/v1/status?window=60"), timeout=10).json()
    assert body["object"] == "status" and body["gateway"] is False and "tenants" not in body
    assert body["totals"]["generation_tokens"] >= 4
    assert body["latency"]["ttft"]["count"] >= 1 and body["latency"]["ttft"]["p50"] is not None
    assert set(body["now"]) == {"running", "waiting", "in_progress", "kv_blocks_used",
                                "kv_blocks_total"}
    bad = httpx.get(fake_server.url("/v1/status?window=1e9"), timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_window"
