"""Idempotency-Key store on a real SQLite file."""
from __future__ import annotations

import sqlite3
import threading

import pytest

from llmserve.gateway.billing.idempotency import (
    BeginOutcome,
    IdempotencyStore,
    hash_request_body,
    validate_idempotency_key,
)
from llmserve.gateway.errors import IdempotencyConflict, IdempotencyMismatch, InvalidRequest
from tests.gateway.race import run_racing

BODY = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
H = hash_request_body(BODY, "/v1/chat/completions")
OTHER = hash_request_body({**BODY, "max_tokens": 6}, "/v1/chat/completions")


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "gateway.db"


@pytest.fixture
def store(db_path, clock):
    s = IdempotencyStore(db_path, ttl_s=100.0, lease_s=50.0, clock=clock)
    yield s
    s.close()


def test_body_hash_is_canonical_and_endpoint_scoped():
    reordered = {"max_tokens": 5, "messages": [{"content": "hi", "role": "user"}], "model": "default"}
    assert hash_request_body(reordered, "/v1/chat/completions") == H
    assert hash_request_body(BODY, "/v1/completions") != H
    assert OTHER != H and H.startswith("sha256:") and len(H) == 7 + 64


def test_first_runs_repeat_while_running_is_409_different_body_is_422(store):
    assert store.begin("acme", "k1", H, request_id="req-1").outcome is BeginOutcome.NEW
    with pytest.raises(IdempotencyConflict) as info:
        store.begin("acme", "k1", H)
    assert info.value.status == 409
    with pytest.raises(IdempotencyMismatch) as info:
        store.begin("acme", "k1", OTHER)
    assert info.value.status == 422


def test_completed_json_response_is_replayed(store):
    store.begin("acme", "k1", H, request_id="req-1")
    body = {"id": "chatcmpl-1", "choices": [{"message": {"content": "héllo"}, "finish_reason": "stop"}]}
    assert store.complete("acme", "k1", 200, body=body, headers={"X-Request-Id": "req-1"}, request_id="req-1")
    result = store.begin("acme", "k1", H)
    assert result.outcome is BeginOutcome.REPLAY
    response = result.response
    assert (response.status, response.body, response.headers) == (200, body, {"X-Request-Id": "req-1"})
    assert not response.streamed and response.request_id == "req-1"
    with pytest.raises(IdempotencyMismatch):
        store.begin("acme", "k1", OTHER)


def test_streamed_response_replays_the_same_events(store):
    events = ['{"id":"c1","choices":[{"delta":{"content":"Hel"}}]}',
              '{"id":"c1","choices":[{"delta":{"content":"lo"},"finish_reason":"abort"}]}',
              "[DONE]"]
    store.begin("acme", "k1", H)
    assert store.complete("acme", "k1", 200, events=events)
    response = store.begin("acme", "k1", H).response
    assert response.streamed and response.events == events and response.body is None


def test_keys_are_scoped_by_tenant(store):
    assert store.begin("acme", "shared-key", H).outcome is BeginOutcome.NEW
    assert store.begin("beta", "shared-key", OTHER).outcome is BeginOutcome.NEW


def test_abandon_frees_the_key_but_never_drops_a_completed_record(store):
    store.begin("acme", "k1", H, request_id="req-1")
    assert not store.abandon("acme", "k1", request_id="someone-else")
    assert store.abandon("acme", "k1", request_id="req-1")
    assert store.begin("acme", "k1", OTHER).outcome is BeginOutcome.NEW  # a fresh start, any body
    store.complete("acme", "k1", 200, body={"ok": True})
    assert not store.abandon("acme", "k1")
    assert store.begin("acme", "k1", OTHER).outcome is BeginOutcome.REPLAY


def test_complete_only_the_owner_and_only_once(store):
    store.begin("acme", "k1", H, request_id="req-1")
    assert not store.complete("acme", "k1", 200, body={}, request_id="req-2")
    assert store.complete("acme", "k1", 200, body={"n": 1}, request_id="req-1")
    assert not store.complete("acme", "k1", 200, body={"n": 2})
    assert store.begin("acme", "k1", H).response.body == {"n": 1}
    assert not store.complete("acme", "never-begun", 200, body={})
    with pytest.raises(ValueError):
        store.complete("acme", "k1", 200)
    with pytest.raises(ValueError):
        store.complete("acme", "k1", 200, body={}, events=["x"])


def test_completed_records_expire_after_ttl(store, clock):
    store.begin("acme", "k1", H)
    clock.advance(40)
    store.complete("acme", "k1", 200, body={"n": 1})
    clock.advance(99.9)  # ttl counts from completion
    assert store.begin("acme", "k1", H).outcome is BeginOutcome.REPLAY
    clock.advance(0.1)
    assert store.begin("acme", "k1", OTHER).outcome is BeginOutcome.NEW


def test_an_unfinished_record_is_taken_over_after_its_lease(store, clock):
    store.begin("acme", "k1", H, request_id="crashed")
    clock.advance(49)
    with pytest.raises(IdempotencyConflict):
        store.begin("acme", "k1", H)
    clock.advance(1)
    assert store.begin("acme", "k1", H, request_id="retry").outcome is BeginOutcome.NEW
    assert not store.complete("acme", "k1", 200, body={}, request_id="crashed")
    assert store.complete("acme", "k1", 200, body={}, request_id="retry")


def test_purge_expired(store, clock, db_path):
    for i in range(3):
        store.begin("acme", f"k{i}", H)
    store.complete("acme", "k0", 200, body={})
    clock.advance(60)  # the two unfinished ones are past their lease
    assert store.purge_expired() == 2
    clock.advance(100)
    assert store.purge_expired() == 1
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM idempotency_keys").fetchone()[0] == 0


def test_records_survive_a_restart(db_path, clock):
    first = IdempotencyStore(db_path, ttl_s=100.0, clock=clock)
    first.begin("acme", "done", H)
    first.complete("acme", "done", 201, events=["a", "[DONE]"], headers={"X-Served-By": "small"})
    first.begin("acme", "running", H)
    first.close()
    second = IdempotencyStore(db_path, ttl_s=100.0, clock=clock)
    replay = second.begin("acme", "done", H).response
    assert (replay.status, replay.events, replay.headers) == (201, ["a", "[DONE]"], {"X-Served-By": "small"})
    with pytest.raises(IdempotencyConflict):
        second.begin("acme", "running", H)
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    second.close()


def test_threads_racing_begin_get_exactly_one_new(db_path):
    stores = [IdempotencyStore(db_path) for _ in range(2)]  # two "processes" on one file
    outcomes: list[str] = []
    lock = threading.Lock()

    def worker(i: int):
        try:
            result = stores[i % 2].begin("acme", "race", H, request_id=f"req-{i}")
            tag = result.outcome.value
        except IdempotencyConflict:
            tag = "409"
        with lock:
            outcomes.append(tag)

    run_racing(16, worker)
    assert sorted(outcomes) == ["409"] * 15 + ["new"]
    for s in stores:
        s.close()


@pytest.mark.parametrize("key", ["", "x" * 256, "tab\there", "ünï"])
def test_malformed_keys_are_400(store, key):
    with pytest.raises(InvalidRequest) as info:
        store.begin("acme", key, H)
    assert info.value.status == 400 and info.value.param == "Idempotency-Key"


def test_valid_key_passes():
    assert validate_idempotency_key("order-42:retry") == "order-42:retry"
