"""Admission: context and KV-pool checks (400), the bounded queue (503), Retry-After."""
from __future__ import annotations

import pytest

from llmserve.gateway.admission.controller import AdmissionController, kv_tokens_needed, parse_request_timeout
from llmserve.gateway.config.gateway_config import QueueConfig
from llmserve.gateway.errors import ContextLengthExceeded, InvalidRequest, OverloadedError
from tests.gateway.race import run_racing


def controller(clock, max_requests=4, max_tokens=1000, timeout_s=30.0, pool=4096, max_len=2048, block=16):
    return AdmissionController(max_requests, max_tokens, timeout_s, pool, max_len, block, clock=clock)


@pytest.mark.parametrize("prompt, max_tokens, need", [(10, 6, 16), (10, 7, 32), (0, 16, 16), (1, 1, 16), (100, 100, 208)])
def test_kv_need_is_rounded_up_to_whole_blocks(prompt, max_tokens, need):
    assert kv_tokens_needed(prompt, max_tokens, 16) == need


def test_context_length_check(clock):
    adm = controller(clock, max_len=100)
    assert adm.check_request(60, 40) == 112
    with pytest.raises(ContextLengthExceeded) as info:
        adm.check_request(60, 41)
    err = info.value
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "max_tokens")
    assert "maximum context length is 100 tokens" in err.message and "101 tokens" in err.message
    assert adm.stats().rejected_invalid_total == 1


def test_kv_need_beyond_the_whole_pool_is_400(clock):
    adm = controller(clock, pool=64, max_len=1000)
    assert adm.check_request(50, 14) == 64
    with pytest.raises(InvalidRequest) as info:
        adm.check_request(50, 15)  # ceil(65 / 16) * 16 = 80 > 64
    assert info.value.status == 400 and info.value.code == "kv_cache_capacity_exceeded"
    assert "80 tokens of KV cache" in info.value.message and "64 tokens" in info.value.message


def test_queue_overflows_by_count_with_retry_after_bounded_by_the_oldest_deadline(clock):
    adm = controller(clock, max_requests=2, timeout_s=30.0)
    adm.enter_queue(10)
    clock.advance(5)
    adm.enter_queue(10)
    clock.advance(5)
    assert adm.would_overload(10)
    with pytest.raises(OverloadedError) as info:
        adm.enter_queue(10)
    # no departures yet: the oldest ticket leaves by its deadline, 30 - 10 = 20 s from now
    assert info.value.status == 503 and info.value.retry_after == pytest.approx(20.0)
    assert info.value.headers()["Retry-After"] == "20"
    stats = adm.stats()
    assert (stats.queued_requests, stats.queued_tokens, stats.admitted_total, stats.rejected_overload_total) == (2, 20, 2, 1)


def test_queue_overflows_by_tokens(clock):
    adm = controller(clock, max_requests=10, max_tokens=100, timeout_s=30.0)
    first = adm.enter_queue(30)
    clock.advance(1)
    adm.enter_queue(30)
    clock.advance(1)
    adm.enter_queue(30)
    assert not adm.would_overload(10) and adm.would_overload(11)
    clock.advance(1)
    with pytest.raises(OverloadedError) as info:
        adm.enter_queue(45)  # 35 short: the two oldest (60 tokens) must leave; the 2nd's deadline is t=31
    assert info.value.retry_after == pytest.approx(28.0)
    first.leave()
    adm.enter_queue(40)
    assert adm.stats().queued_tokens == 100


def test_retry_after_uses_the_observed_departure_rate(clock):
    adm = controller(clock, max_requests=1, timeout_s=30.0)
    for _ in range(10):  # one request per second passes through the queue
        ticket = adm.enter_queue(10)
        clock.advance(0.5)
        ticket.leave()
        clock.advance(0.5)
    adm.enter_queue(10)
    with pytest.raises(OverloadedError) as info:
        adm.enter_queue(10)
    # 10 departures over the 9.5 s since the first: one slot frees in about 0.95 s
    assert info.value.retry_after == pytest.approx(0.95)
    assert info.value.headers()["Retry-After"] == "1"


def test_empty_queue_takes_a_request_larger_than_the_token_budget(clock):
    adm = controller(clock, max_tokens=100)
    big = adm.enter_queue(500)
    assert adm.would_overload(1)
    big.leave()
    assert not adm.would_overload(500)


def test_ticket_timeout_and_leave(clock):
    adm = controller(clock, timeout_s=30.0)
    ticket = adm.enter_queue(10)
    clock.advance(29)
    assert not ticket.expired() and ticket.remaining() == pytest.approx(1.0)
    clock.advance(1)
    assert ticket.expired()
    assert ticket.leave(timed_out=True) == pytest.approx(30.0)
    assert ticket.leave() == pytest.approx(30.0)  # leaving twice changes nothing
    assert not ticket.active
    stats = adm.stats()
    assert (stats.queued_requests, stats.queued_tokens, stats.timed_out_total) == (0, 0, 1)
    with adm.enter_queue(20) as scoped:
        assert adm.stats().queued_tokens == 20
    assert not scoped.active and adm.stats().queued_tokens == 0


def test_from_config(clock):
    adm = AdmissionController.from_config(QueueConfig(3, 300, 7.5), kv_pool_tokens=512,
                                          max_model_len=256, block_size=32, clock=clock)
    assert (adm.max_queue_requests, adm.max_queue_tokens, adm.queue_timeout_s) == (3, 300, 7.5)
    assert adm.check_request(1, 32) == 64
    with pytest.raises(ValueError):
        AdmissionController(0, 10, 1.0, 10, 10)


def test_concurrent_entries_respect_the_count_bound(clock):
    adm = controller(clock, max_requests=5, max_tokens=10**6)
    admitted, rejected = [], []

    def worker(_: int) -> None:
        try:
            admitted.append(adm.enter_queue(10))
        except OverloadedError:
            rejected.append(1)

    run_racing(12, worker)
    assert len(admitted) == 5 and len(rejected) == 7
    assert adm.stats().queued_tokens == 50


@pytest.mark.parametrize("header, seconds", [(None, None), ("", None), ("2.5", 2.5), (" 30 ", 30.0)])
def test_request_timeout_header(header, seconds):
    assert parse_request_timeout(header) == seconds


@pytest.mark.parametrize("header", ["0", "-1", "soon", "inf", "nan"])
def test_bad_request_timeout_header_is_400(header):
    with pytest.raises(InvalidRequest) as info:
        parse_request_timeout(header)
    assert info.value.status == 400 and info.value.param == "X-Request-Timeout"
