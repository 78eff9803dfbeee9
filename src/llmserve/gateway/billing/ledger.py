"""The billing ledger: one usage record per request that reached the engine, in SQLite.

Exactly-once billing rests on two uniqueness constraints of the ``usage`` table:

* ``request_id`` is UNIQUE: recording the same request twice (a retry of the write, a
  crash between writing and acknowledging) inserts one row;
* ``(tenant, idempotency_key, idempotency_run)`` is UNIQUE where the key is not null (a
  partial unique index): one *run* of a key -- the claim the idempotency store handed
  out -- is billed at most once, while a key reused after its record expired is a new
  run and is billed again (it really ran again). Records written without a run id
  collide on ``(tenant, idempotency_key)`` alone, as before.

``cache_hit`` (added to older files on open) marks a response-cache hit: the row
records the usage of the answer it replayed, but the engine did no work for it (the
price rule is in docs/CACHING.md).

``record()`` uses ``INSERT ... ON CONFLICT DO NOTHING``: a duplicate returns False and
never raises. A cancelled, timed-out or aborted request is recorded with the tokens
actually computed (prompt tokens it prefilled, completion tokens it produced) and its
finish reason. Timestamps are Unix epoch seconds (UTC); ``since`` filters on
``finished_at``. The file may be shared with the idempotency store; then
:meth:`BillingLedger.insert` lets the store commit a usage record and the idempotent
response in one transaction.

The CSV export neutralises formula injection: a text cell that starts with ``=``,
``+``, ``-``, ``@``, a tab or a carriage return gets a leading ``'`` (the OWASP
recommendation), so a client-chosen Idempotency-Key such as ``=HYPERLINK(...)`` is
shown as text by spreadsheet programs.

Thread-safe; blocking (call it from a worker thread in async code).
"""
from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import logging
import os
import sqlite3
from dataclasses import dataclass
from typing import IO, Any, Optional, Union

from llmserve.gateway.sqlite_db import SQLiteDatabase, add_missing_columns

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    record_id INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant TEXT NOT NULL,
    request_id TEXT NOT NULL UNIQUE,
    idempotency_key TEXT,
    model TEXT NOT NULL,
    served_model TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL CHECK (prompt_tokens >= 0),
    cached_tokens INTEGER NOT NULL CHECK (cached_tokens >= 0),
    completion_tokens INTEGER NOT NULL CHECK (completion_tokens >= 0),
    finish_reason TEXT NOT NULL,
    status INTEGER NOT NULL,
    created_at REAL NOT NULL,
    finished_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_finished_at ON usage (finished_at);
"""

#: Replaces the (tenant, idempotency_key) index of ledgers written before run ids existed.
_RUN_INDEX = """
DROP INDEX IF EXISTS usage_tenant_idempotency_key;
CREATE UNIQUE INDEX IF NOT EXISTS usage_tenant_idempotency_run
    ON usage (tenant, idempotency_key, COALESCE(idempotency_run, ''))
    WHERE idempotency_key IS NOT NULL;
"""

#: First characters that make a spreadsheet treat a CSV cell as a formula.
_FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")

_COLUMNS = ("tenant", "request_id", "idempotency_key", "model", "served_model", "fingerprint",
            "prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason", "status",
            "created_at", "finished_at", "idempotency_run", "cache_hit", "release_id",
            "release_fingerprint")

#: Columns of ``export_csv``, in order; timestamps as ISO-8601 UTC.
CSV_COLUMNS = (("record_id",) + _COLUMNS[:9] + ("total_tokens",) + _COLUMNS[9:13]
               + ("cache_hit", "release_id", "release_fingerprint"))

Since = Union[str, dt.date, dt.datetime, float, int, None]


@dataclass(frozen=True)
class UsageRecord:
    """What one request used. ``served_model`` defaults to ``model`` (differs after a fallback).

    ``prompt_tokens`` counts the whole prompt, ``cached_tokens`` the part of it served
    from the prefix cache; ``record_id`` is assigned by the ledger.
    """

    tenant: str
    request_id: str
    model: str
    fingerprint: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    status: int
    created_at: float
    finished_at: float
    idempotency_key: Optional[str] = None
    served_model: Optional[str] = None
    record_id: Optional[int] = None
    idempotency_run: Optional[str] = None   # the idempotency store's run id of the key
    cache_hit: bool = False                 # a response-cache hit: no engine work (price rule:
                                            # docs/CACHING.md)
    release_id: Optional[str] = None        # the release that served it (docs/RELEASES.md)
    release_fingerprint: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("tenant", "request_id", "model", "finish_reason"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"UsageRecord.{name} must be a non-empty string")
        if not isinstance(self.fingerprint, str):
            raise ValueError("UsageRecord.fingerprint must be a string")
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens", "status"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"UsageRecord.{name} must be a non-negative integer, got {value!r}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("UsageRecord.cached_tokens cannot exceed prompt_tokens")
        if self.finished_at < self.created_at:
            raise ValueError("UsageRecord.finished_at is before created_at")
        if self.served_model is None:
            object.__setattr__(self, "served_model", self.model)
        object.__setattr__(self, "cache_hit", bool(self.cache_hit))

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def parse_since(value: Since) -> Optional[float]:
    """A ``since`` bound as epoch seconds.

    Accepts None, epoch seconds, a ``date`` (midnight UTC), a ``datetime`` (naive means
    UTC) or an ISO-8601 string of either (``2024-05-01``, ``2024-05-01T12:00:00Z``,
    ``2024-05-01T14:00:00+02:00``). Raises ValueError for anything else.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"not a time: {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        try:
            value = dt.datetime.fromisoformat(text) if ("T" in text or " " in text) else dt.date.fromisoformat(text)
        except ValueError as e:
            raise ValueError(f"not an ISO-8601 date or datetime: {value!r}") from e
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        return value.timestamp()
    if isinstance(value, dt.date):
        return dt.datetime(value.year, value.month, value.day, tzinfo=dt.timezone.utc).timestamp()
    raise ValueError(f"not a time: {value!r}")


def _iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).isoformat(timespec="milliseconds")


def csv_safe(value: Any) -> Any:
    """A CSV cell that no spreadsheet evaluates: text starting with ``= + - @``, a tab or a
    carriage return gets a leading single quote; other values are returned unchanged."""
    if isinstance(value, str) and value.startswith(_FORMULA_PREFIXES):
        return "'" + value
    return value


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring a ledger written by an older version up to the current schema (idempotent)."""
    add_missing_columns(conn, "usage", {"idempotency_run": "TEXT",
                                        "cache_hit": "INTEGER NOT NULL DEFAULT 0",
                                        "release_id": "TEXT", "release_fingerprint": "TEXT"})
    conn.executescript(_RUN_INDEX)


class BillingLedger:
    """Usage records in the ``usage`` table of a SQLite file (WAL mode).

    ``synchronous="FULL"`` (default) makes each record survive power loss; ``"NORMAL"``
    only process crashes, with cheaper commits.
    """

    def __init__(self, db_path: "str | os.PathLike[str]", synchronous: str = "FULL") -> None:
        self._db = SQLiteDatabase(db_path, synchronous=synchronous)
        with self._db.connection() as conn:
            conn.executescript(_SCHEMA)
            _migrate(conn)

    @property
    def path(self) -> str:
        return self._db.path

    def record(self, usage: UsageRecord) -> bool:
        """Insert a usage record; False (and nothing written) when it duplicates an existing
        ``request_id`` or ``(tenant, idempotency_key, idempotency_run)``."""
        with self._db.connection() as conn:
            return self.insert(conn, usage)

    @staticmethod
    def insert(conn: sqlite3.Connection, usage: UsageRecord) -> bool:
        """Insert ``usage`` with the caller's connection (e.g. inside the idempotency
        store's transaction, so that the record and the stored response commit together).
        Returns False for a duplicate, as :meth:`record` does."""
        values = [int(usage.cache_hit) if c == "cache_hit" else getattr(usage, c) for c in _COLUMNS]
        cursor = conn.execute(
            f"INSERT INTO usage ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
            "ON CONFLICT DO NOTHING",
            values,
        )
        inserted = cursor.rowcount == 1
        if not inserted:
            logger.info("usage for request %s (tenant %s, idempotency key %r, run %s) already "
                        "recorded; not billed again", usage.request_id, usage.tenant,
                        usage.idempotency_key, usage.idempotency_run)
        return inserted

    def count(self) -> int:
        """Number of usage records."""
        with self._db.connection() as conn:
            return int(conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0])

    def records(self, since: Since = None, tenant: Optional[str] = None,
                until: Since = None, release: Optional[str] = None) -> list[UsageRecord]:
        """Records with ``since <= finished_at < until`` (bounds optional), of one tenant
        and one release (``release_id``) when given, oldest first."""
        clauses: list[str] = []
        params: list[object] = []
        for op, bound in ((">=", parse_since(since)), ("<", parse_since(until))):
            if bound is not None:
                clauses.append(f"finished_at {op} ?")
                params.append(bound)
        for column, value in (("tenant", tenant), ("release_id", release)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._db.connection() as conn:
            rows = conn.execute(
                f"SELECT record_id, {', '.join(_COLUMNS)} FROM usage {where} ORDER BY finished_at, record_id",
                params,
            ).fetchall()
        return [UsageRecord(**dict(row)) for row in rows]

    def export_csv(self, stream: IO[str], since: Since = None, tenant: Optional[str] = None,
                   until: Since = None, release: Optional[str] = None) -> int:
        """Write matching records as CSV (header row, columns ``CSV_COLUMNS``); returns the row count.

        Text cells are passed through :func:`csv_safe` (formula injection)."""
        writer = csv.writer(stream, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        rows = self.records(since=since, tenant=tenant, until=until, release=release)
        for rec in rows:
            fields = dataclasses.asdict(rec)
            fields["total_tokens"] = rec.total_tokens
            fields["created_at"] = _iso(rec.created_at)
            fields["finished_at"] = _iso(rec.finished_at)
            fields["cache_hit"] = int(rec.cache_hit)
            writer.writerow(["" if fields[c] is None else csv_safe(fields[c]) for c in CSV_COLUMNS])
        return len(rows)

    def close(self) -> None:
        self._db.close()
