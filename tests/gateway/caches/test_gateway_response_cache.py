"""Response-cache policy, key and stores; the ledger's cache_hit column; the cache config."""
from __future__ import annotations

import sqlite3

import pytest

from llmserve.contract.gateway_hook import CapturedResponse
from llmserve.gateway import GatewayConfig, hash_api_key
from llmserve.gateway.billing.ledger import BillingLedger, UsageRecord
from llmserve.gateway.caches.response_cache import cache_key, decide
from llmserve.gateway.caches.response_store import CachedResponse, MemoryResponseStore, SQLiteResponseStore, StoreBounds


def test_only_deterministic_requests_are_cacheable():
    assert decide({"temperature": 0}, {}).lookup
    assert decide({"temperature": 0.7, "seed": 1}, {}).lookup
    assert decide({}, {}).reason == "nondeterministic"              # default temperature 1
    assert decide({"temperature": 0.7}, {}).reason == "nondeterministic"
    assert decide({"temperature": 0, "n": 2}, {}).reason == "nondeterministic"
    assert decide({"temperature": 0, "n": 2, "seed": 3}, {}).lookup
    assert decide({"temperature": 0, "cache": False}, {}).reason == "opt_out"
    assert decide({"temperature": 0}, {"cache-control": "max-age=0, No-Store"}).reason == "no_store"
    no_cache = decide({"temperature": 0}, {"cache-control": "no-cache"})
    assert (no_cache.lookup, no_cache.store) == (False, True)


def test_key_covers_what_changes_the_answer_and_nothing_else():
    base = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 5}
    k = cache_key(fingerprint="fp1", tenant="a", endpoint="chat.completions", body=base)
    same = dict(reversed(list(base.items())), user="u", priority="batch", cache=True)
    assert cache_key(fingerprint="fp1", tenant="a", endpoint="chat.completions", body=same) == k
    for change in ({"max_tokens": 6}, {"stop": ["x"]}, {"stream": True}, {"seed": 1},
                   {"response_format": {"type": "text"}}, {"tools": []}, {"logprobs": True}):
        assert cache_key(fingerprint="fp1", tenant="a", endpoint="chat.completions",
                         body={**base, **change}) != k, change
    assert cache_key(fingerprint="fp2", tenant="a", endpoint="chat.completions", body=base) != k
    assert cache_key(fingerprint="fp1", tenant="b", endpoint="chat.completions", body=base) != k
    assert cache_key(fingerprint="fp1", tenant="a", endpoint="completions", body=base) != k
    assert cache_key(fingerprint="fp1", tenant="a", endpoint="chat.completions", body=base,
                     bundle="tenant:a/x@1") != k


def entry(key: str, tenant: str = "a", size: int = 10) -> CachedResponse:
    return CachedResponse(key=key, tenant=tenant,
                          response=CapturedResponse(200, body={"text": "x" * size}),
                          prompt_tokens=3, completion_tokens=2)


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request, tmp_path, clock):
    def make(**bounds):
        b = StoreBounds(**{"max_entries": 100, "max_bytes": 1 << 20, "ttl_s": 60.0, **bounds})
        if request.param == "memory":
            return MemoryResponseStore(b, clock=clock)
        return SQLiteResponseStore(str(tmp_path / "rc.db"), b, clock=clock)
    return make


def test_store_bounds_lru_and_ttl(make_store, clock):
    store = make_store(max_entries=2)
    for k in ("k1", "k2"):
        assert store.put(entry(k))
        clock.advance(1)
    assert store.get("k1") is not None   # k1 is now the most recently used
    clock.advance(1)
    store.put(entry("k3"))
    assert store.get("k2") is None and store.get("k1") is not None and store.usage()[0] == 2
    assert store.evictions == 1
    clock.advance(61)
    assert store.get("k1") is None and store.get("k3") is None
    small = make_store(max_bytes=400)
    assert not small.put(entry("huge", size=1000))
    assert small.put(entry("a1", size=100)) and small.put(entry("a2", size=100))
    assert small.put(entry("a3", size=100))
    assert small.usage()[1] <= 400 and small.get("a3").completion_tokens == 2
    assert small.flush("nobody") == 0 and small.flush("a") >= 1 and small.usage()[0] == 0


def test_ledger_gains_cache_hit_column_on_old_files(tmp_path):
    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.executescript("""CREATE TABLE usage (record_id INTEGER PRIMARY KEY AUTOINCREMENT,
        tenant TEXT NOT NULL, request_id TEXT NOT NULL UNIQUE, idempotency_key TEXT,
        model TEXT NOT NULL, served_model TEXT NOT NULL, fingerprint TEXT NOT NULL,
        prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL, finish_reason TEXT NOT NULL, status INTEGER NOT NULL,
        created_at REAL NOT NULL, finished_at REAL NOT NULL);
        INSERT INTO usage (tenant, request_id, model, served_model, fingerprint, prompt_tokens,
        cached_tokens, completion_tokens, finish_reason, status, created_at, finished_at)
        VALUES ('a', 'old', 'm', 'm', 'fp', 5, 0, 2, 'stop', 200, 1, 2);""")
    conn.commit()
    conn.close()
    ledger = BillingLedger(db)
    ledger.record(UsageRecord(tenant="a", request_id="hit", model="m", fingerprint="fp",
                              prompt_tokens=5, cached_tokens=5, completion_tokens=2,
                              finish_reason="stop", status=200, created_at=3, finished_at=4,
                              cache_hit=True))
    assert [(r.request_id, r.cache_hit) for r in ledger.records()] == [("old", False), ("hit", True)]
    ledger.close()


def test_cache_config_is_validated():
    tenants = {"a": {"keys": [hash_api_key("k")], "response_cache": True}}
    with pytest.raises(ValueError, match="database"):
        GatewayConfig.from_dict({"tenants": tenants})
    cfg = GatewayConfig.from_dict({"tenants": tenants, "response_cache": {"store": "memory"},
                                   "admin": {"keys": [hash_api_key("admin")]},
                                   "prompt_bundles": {"pinned_blocks_per_tenant": 0},
                                   "cache_audit": {"sample_rate": 0.5}})
    assert cfg.tenants["a"].response_cache and cfg.bundle_budget(cfg.tenants["a"]) == 0
    assert cfg.cache_audit.sample_rate == 0.5
    for bad, match in (({"admin": {"keys": ["plain"]}}, "admin.keys"),
                       ({"admin": {"keys": [hash_api_key("k")]}}, "tenant 'a'"),
                       ({"response_cache": {"store": "redis"}}, "store"),
                       ({"response_cache": {"max_entries": 0}}, "max_entries"),
                       ({"cache_audit": {"sample_rate": 2}}, "sample_rate"),
                       ({"prompt_bundles": {"bogus": 1}}, "unknown key")):
        with pytest.raises(ValueError, match=match):
            GatewayConfig.from_dict({"tenants": tenants, "database": "/tmp/x.db", **bad})
