"""Billing ledger on a real SQLite file: exactly-once records, restart, CSV export."""
from __future__ import annotations

import csv
import datetime as dt
import io
import sqlite3
import threading

import pytest

from llmserve.gateway.billing.idempotency import IdempotencyStore, hash_request_body
from llmserve.gateway.billing.ledger import CSV_COLUMNS, BillingLedger, UsageRecord, parse_since
from tests.gateway.race import run_racing

MAY_1 = dt.datetime(2024, 5, 1, tzinfo=dt.timezone.utc).timestamp()
DAY = 86400.0


def usage(request_id: str, tenant: str = "acme", key: "str | None" = None, finished: float = MAY_1 + 60,
          **overrides) -> UsageRecord:
    fields = dict(tenant=tenant, request_id=request_id, model="default", fingerprint="fp-1",
                  prompt_tokens=12, cached_tokens=4, completion_tokens=7, finish_reason="stop",
                  status=200, created_at=finished - 1.5, finished_at=finished, idempotency_key=key)
    fields.update(overrides)
    return UsageRecord(**fields)


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "gateway.db"


@pytest.fixture
def ledger(db_path):
    led = BillingLedger(db_path)
    yield led
    led.close()


def test_duplicates_by_request_id_or_idempotency_key_are_ignored(ledger):
    assert ledger.record(usage("req-1", key="k1"))
    assert not ledger.record(usage("req-1", key="k1"))
    assert not ledger.record(usage("req-1", completion_tokens=99))       # same request id
    assert not ledger.record(usage("req-2", key="k1"))                   # same tenant + key
    assert ledger.record(usage("req-3", tenant="beta", key="k1"))        # key scoped by tenant
    assert ledger.record(usage("req-4")) and ledger.record(usage("req-5"))  # null keys never clash
    assert ledger.count() == 4
    assert ledger.records(tenant="acme")[0].completion_tokens == 7


def test_fields_round_trip_and_served_model_defaults_to_model(ledger):
    rec = usage("req-1", key="k", finish_reason="timeout", status=200, served_model="small", model="big")
    ledger.record(rec)
    ledger.record(usage("req-2"))
    first, second = ledger.records()
    assert first.record_id is not None and first == UsageRecord(**{**rec.__dict__, "record_id": first.record_id})
    assert second.served_model == "default" and second.idempotency_key is None


def test_concurrent_inserts_write_each_record_once(db_path):
    ledgers = [BillingLedger(db_path) for _ in range(2)]
    inserted: list[str] = []
    lock = threading.Lock()

    def worker(i: int):
        for n in range(25):
            if ledgers[i % 2].record(usage(f"req-{n}", key=f"key-{n}")):
                with lock:
                    inserted.append(f"req-{n}")

    run_racing(8, worker)
    assert sorted(inserted) == sorted(f"req-{n}" for n in range(25))
    assert ledgers[0].count() == 25
    for led in ledgers:
        led.close()


def test_restart_keeps_records_and_still_rejects_duplicates(db_path):
    first = BillingLedger(db_path)
    first.record(usage("req-1", key="k1"))
    first.close()
    second = BillingLedger(db_path)
    assert second.count() == 1
    assert not second.record(usage("req-9", key="k1"))
    assert not second.record(usage("req-1"))
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    second.close()


def test_shares_a_file_with_the_idempotency_store(db_path, ledger):
    store = IdempotencyStore(db_path)
    store.begin("acme", "k1", hash_request_body({"a": 1}))
    ledger.record(usage("req-1", key="k1"))
    store.complete("acme", "k1", 200, body={"ok": True})
    assert ledger.count() == 1
    assert store.begin("acme", "k1", hash_request_body({"a": 1})).response.body == {"ok": True}
    store.close()


def test_export_csv_since_filters_on_finish_time(ledger):
    ledger.record(usage("old", finished=MAY_1 - 10))
    ledger.record(usage("may-1", finished=MAY_1 + 10, key="k"))
    ledger.record(usage("may-2", tenant="beta", finished=MAY_1 + DAY + 10))
    out = io.StringIO()
    assert ledger.export_csv(out, since="2024-05-01") == 2
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert [r["request_id"] for r in rows] == ["may-1", "may-2"]
    assert rows[0]["idempotency_key"] == "k" and rows[1]["idempotency_key"] == ""
    assert (rows[0]["prompt_tokens"], rows[0]["cached_tokens"], rows[0]["completion_tokens"],
            rows[0]["total_tokens"]) == ("12", "4", "7", "19")
    assert rows[0]["finished_at"] == "2024-05-01T00:00:10.000+00:00"
    assert rows[0]["created_at"] == "2024-05-01T00:00:08.500+00:00"
    out = io.StringIO()
    assert ledger.export_csv(out, since="2024-05-02T00:00:00Z") == 1
    out = io.StringIO()
    assert ledger.export_csv(out, since="2024-05-01T02:00:00+02:00", tenant="acme") == 1
    assert ledger.export_csv(io.StringIO()) == 3


@pytest.mark.parametrize("value, expected", [
    ("2024-05-01", MAY_1),
    ("2024-05-01T00:00:00", MAY_1),
    ("2024-05-01T00:00:00Z", MAY_1),
    ("2024-05-01T03:00:00+03:00", MAY_1),
    ("2024-05-01 00:00:30", MAY_1 + 30),
    (dt.date(2024, 5, 1), MAY_1),
    (dt.datetime(2024, 5, 1), MAY_1),
    (MAY_1, MAY_1),
    (None, None),
])
def test_parse_since(value, expected):
    assert parse_since(value) == expected


@pytest.mark.parametrize("bad", ["yesterday", "2024-13-01", True, [1]])
def test_parse_since_rejects_garbage(bad):
    with pytest.raises(ValueError):
        parse_since(bad)


@pytest.mark.parametrize("overrides", [
    {"tenant": ""}, {"prompt_tokens": -1}, {"completion_tokens": 1.5}, {"cached_tokens": 13},
    {"finish_reason": None}, {"created_at": MAY_1 + 61},
])
def test_invalid_records_are_refused(overrides):
    with pytest.raises(ValueError):
        usage("r", **overrides)
