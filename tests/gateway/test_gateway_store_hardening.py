"""Hardening of the gateway's SQLite stores (issue 13): key reuse after the TTL is billed,
leases of dead processes are reclaimed, 409 carries Retry-After, expired records are purged
periodically, and the CSV export cannot inject spreadsheet formulas. Real SQLite files."""
from __future__ import annotations

import csv
import io
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from llmserve.contract.gateway_hook import CapturedResponse
from llmserve.gateway.billing.idempotency import BeginOutcome, IdempotencyStore, hash_request_body
from llmserve.gateway.billing.ledger import BillingLedger, UsageRecord, csv_safe
from llmserve.gateway.billing.usage import write_outcome
from llmserve.gateway.config.gateway_config import GatewayConfig, hash_api_key
from llmserve.gateway.errors import IdempotencyConflict
from llmserve.gateway.hook import TenantGateway
from llmserve.gateway.process_identity import ProcessIdentity, current_process
from tests.server.server_fakes import FakeEngine

H = hash_request_body({"prompt": "hi"}, "completions")


def usage(request_id: str, key: "str | None" = None, run: "str | None" = None, **kw) -> UsageRecord:
    fields = dict(tenant="acme", request_id=request_id, model="m", fingerprint="fp",
                  prompt_tokens=5, cached_tokens=0, completion_tokens=3, finish_reason="stop",
                  status=200, created_at=1000.0, finished_at=1001.0, idempotency_key=key,
                  idempotency_run=run)
    fields.update(kw)
    return UsageRecord(**fields)


def dead_owner() -> str:
    """The lease token of a process of this host that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = ProcessIdentity.of_pid(proc.pid)
    proc.wait()
    return identity.token


@pytest.fixture
def db(tmp_path):
    return tmp_path / "gateway.db"


def test_key_reused_after_its_ttl_is_billed_again(db, clock) -> None:
    store = IdempotencyStore(db, ttl_s=60, clock=clock)
    ledger = BillingLedger(db)
    first = store.begin("acme", "k", H, request_id="r1")
    write_outcome(ledger, store, usage("r1", "k", first.run_id), key="k", run_id=first.run_id,
                  request_id="r1", response=CapturedResponse(200, body={"n": 1}))
    assert store.begin("acme", "k", H).outcome is BeginOutcome.REPLAY
    clock.advance(61)                                      # the stored response expired
    second = store.begin("acme", "k", H, request_id="r2")
    assert second.outcome is BeginOutcome.NEW and second.run_id != first.run_id
    write_outcome(ledger, store, usage("r2", "k", second.run_id), key="k", run_id=second.run_id,
                  request_id="r2", response=CapturedResponse(200, body={"n": 2}))
    assert [r.request_id for r in ledger.records()] == ["r1", "r2"]   # the rerun was billed
    assert store.begin("acme", "k", H).response.body == {"n": 2}
    assert not ledger.record(usage("r3", "k", second.run_id))          # one run, one bill
    store.close()
    ledger.close()


def test_an_old_ledger_is_migrated_to_run_ids(db) -> None:
    with sqlite3.connect(db) as conn:  # the schema written before run ids existed
        conn.executescript("""
            CREATE TABLE usage (record_id INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL,
                request_id TEXT NOT NULL UNIQUE, idempotency_key TEXT, model TEXT NOT NULL,
                served_model TEXT NOT NULL, fingerprint TEXT NOT NULL, prompt_tokens INTEGER NOT NULL,
                cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
                finish_reason TEXT NOT NULL, status INTEGER NOT NULL, created_at REAL NOT NULL,
                finished_at REAL NOT NULL);
            CREATE UNIQUE INDEX usage_tenant_idempotency_key ON usage (tenant, idempotency_key)
                WHERE idempotency_key IS NOT NULL;
            INSERT INTO usage (tenant, request_id, idempotency_key, model, served_model, fingerprint,
                prompt_tokens, cached_tokens, completion_tokens, finish_reason, status, created_at,
                finished_at) VALUES ('acme', 'old', 'k', 'm', 'm', 'fp', 1, 0, 1, 'stop', 200, 1, 2);
        """)
    ledger = BillingLedger(db)
    assert ledger.record(usage("new", "k", "run-2"))        # a later run of the same key
    assert not ledger.record(usage("again", "k"))            # run-less records still collide
    assert ledger.count() == 2
    ledger.close()


def test_the_lease_of_a_killed_process_is_reclaimed_at_start_up(db) -> None:
    crashed = IdempotencyStore(db, owner=dead_owner(), reclaim=False)
    crashed.begin("acme", "k", H, request_id="r1")          # in flight when its process died
    crashed.close()
    restarted = IdempotencyStore(db)                         # opening the store reclaims it
    assert restarted.begin("acme", "k", H, request_id="r2").outcome is BeginOutcome.NEW
    restarted.close()


def test_begin_takes_over_a_dead_owners_key_but_not_a_live_ones(db) -> None:
    store = IdempotencyStore(db)
    dead = IdempotencyStore(db, owner=dead_owner(), reclaim=False)
    dead.begin("acme", "dead-key", H)
    assert store.begin("acme", "dead-key", H).outcome is BeginOutcome.NEW
    live = IdempotencyStore(db, owner=ProcessIdentity.of_pid(os.getppid()).token, reclaim=False)
    live.begin("acme", "live-key", H)
    with pytest.raises(IdempotencyConflict) as info:
        store.begin("acme", "live-key", H)
    assert info.value.status == 409 and info.value.headers()["Retry-After"] == "1"
    for s in (store, dead, live):
        s.close()


def test_process_identity_liveness() -> None:
    me = current_process()
    assert ProcessIdentity.parse(me.token) == me and me.is_alive() is True
    assert ProcessIdentity.parse(dead_owner()).is_alive() is False
    reused_pid = ProcessIdentity(me.host, me.boot_id, me.pid, me.start + "0")
    assert reused_pid.is_alive() is False
    assert ProcessIdentity("elsewhere", "b", 1, "1").is_alive() is None  # unknowable
    assert ProcessIdentity.parse("garbage") is None


def test_expired_records_are_purged_periodically(db) -> None:
    store = IdempotencyStore(db, ttl_s=0.05)
    store.begin("acme", "k", H, request_id="r1")
    store.complete("acme", "k", 200, body={"ok": True}, request_id="r1")
    config = GatewayConfig.from_dict({"tenants": {"t": {"keys": [hash_api_key("x")]}}})
    gateway = TenantGateway(config, {"m": FakeEngine()}, store=store, purge_interval_s=0.05)

    def rows() -> int:
        with sqlite3.connect(db) as conn:
            return conn.execute("SELECT COUNT(*) FROM idempotency_keys").fetchone()[0]

    deadline = time.monotonic() + 5
    while rows() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rows() == 0 and gateway._purger.runs >= 1
    gateway.close()


@pytest.mark.parametrize("value, expected", [
    ("=HYPERLINK(\"http://x\",\"y\")", "'=HYPERLINK(\"http://x\",\"y\")"),
    ("+1", "'+1"), ("-2", "'-2"), ("@SUM(A1)", "'@SUM(A1)"), ("\tx", "'\tx"), ("\rx", "'\rx"),
    ("plain", "plain"), ("a=b", "a=b"), (12, 12),
])
def test_csv_safe(value, expected) -> None:
    assert csv_safe(value) == expected


def test_billing_export_neutralises_formula_cells(db, tmp_path) -> None:
    ledger = BillingLedger(db)
    ledger.record(usage("-req", key="=HYPERLINK(\"http://evil\",\"click\")"))
    ledger.close()
    result = subprocess.run([sys.executable, "-m", "llmserve.cli", "billing", "export",
                             "--database", str(db)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    row, = csv.DictReader(io.StringIO(result.stdout))
    assert row["idempotency_key"] == "'=HYPERLINK(\"http://evil\",\"click\")"
    assert row["request_id"] == "'-req" and row["tenant"] == "acme"
