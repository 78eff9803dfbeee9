"""Idempotency keys: run a request once, replay its response to retries.

Records live in SQLite (table ``idempotency_keys``, WAL mode, may share the ledger's
file), keyed by ``(tenant, key)``, so keys of different tenants never collide and a
record survives a process restart. Each record holds the sha256 of the canonical
request (``hash_request_body``), a state, and once completed the response: status,
a subset of headers, and either the JSON body or, for a streamed response, the exact
list of SSE ``data:`` payloads in order.

``begin(tenant, key, body_hash)`` runs in a ``BEGIN IMMEDIATE`` transaction, so of
any number of concurrent callers (threads or processes) exactly one gets ``NEW``:

==========================  ================  ==============================
existing record             same body hash    different body hash
==========================  ================  ==============================
none, or expired            NEW (record it)   NEW (record it)
in_progress                 409 conflict      422 mismatch
completed                   REPLAY            422 mismatch
==========================  ================  ==============================

The caller that got NEW receives a *run id* (``BeginResult.run_id``), unique to this
claim of the key, and must end with exactly one of

* ``complete(...)`` once the request reached the engine and has a response (any
  finish reason, including timeouts): later retries replay it and are not billed;
  ``complete(..., also=fn)`` runs ``fn(conn)`` in the same transaction (the gateway
  inserts the usage record there, so the bill and the stored response commit
  together or not at all);
* ``abandon(...)`` when it failed before reaching the engine (401/403/429/503, a 400
  from admission, an internal error before scheduling), so that a retry may run.

Client disconnected mid-stream: the request is aborted in the engine, billed for what
was computed, and the record is COMPLETED with the partial response: the SSE payloads
already produced, then a final chunk whose ``finish_reason`` is ``"abort"``, then
``[DONE]`` (the HTTP layer builds these payloads). A retry with the same key therefore
replays the partial response and is not billed again; to get a full answer the client
sends a new key. This keeps "one key, one billed run" without exceptions.

Expiry: a completed record is replayable for ``ttl_s`` seconds after completion, then
the key is free again and its next use is a new run (new run id, billed again). An
``in_progress`` record names its owner process (:mod:`.process_identity`) and is held
for ``lease_s`` seconds. It is taken over as NEW when the lease has run out or, sooner,
when its owner is certainly dead: ``reclaim_dead_owners()`` (run when a store opens,
i.e. at server start-up) drops every such record, and ``begin`` checks the owner of
a record it finds. ``purge_expired()`` deletes expired records; the gateway runs it
periodically. Times are wall-clock (``time.time``) because they persist.

Thread-safe; blocking (call it from a worker thread in async code).
"""
from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from llmserve.contract.gateway_hook import CapturedResponse
from llmserve.gateway.errors import IdempotencyConflict, IdempotencyMismatch, InvalidRequest
from llmserve.gateway.process_identity import current_process, owner_is_dead
from llmserve.gateway.sqlite_db import SQLiteDatabase, add_missing_columns

logger = logging.getLogger(__name__)

IDEMPOTENCY_HEADER = "Idempotency-Key"
#: Response header the HTTP layer adds to a replayed response.
REPLAYED_HEADER = "Idempotent-Replayed"
MAX_KEY_LENGTH = 255
PURGE_INTERVAL_S = 60.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency_keys (
    tenant TEXT NOT NULL,
    key TEXT NOT NULL,
    body_hash TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('in_progress', 'completed')),
    request_id TEXT,
    status INTEGER,
    headers TEXT,
    body TEXT,
    events TEXT,
    created_at REAL NOT NULL,
    completed_at REAL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON idempotency_keys (expires_at);
"""

#: Columns added after the first version of the table (added to old files on open).
_ADDED_COLUMNS = {"run_id": "TEXT", "owner": "TEXT"}

#: ``Retry-After`` of a 409: the first request is still running and usually ends soon.
CONFLICT_RETRY_AFTER_S = 1.0


def validate_idempotency_key(key: str) -> str:
    """Return the key if it is 1-255 printable ASCII characters; else raise InvalidRequest (400)."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH or \
            not all(" " <= ch <= "~" for ch in key):
        raise InvalidRequest(
            f"{IDEMPOTENCY_HEADER} must be 1-{MAX_KEY_LENGTH} printable ASCII characters",
            code="invalid_idempotency_key", param=IDEMPOTENCY_HEADER,
        )
    return key


def canonical_json(obj: Any) -> str:
    """Keys sorted, no insignificant whitespace, UTF-8 kept, no NaN: equal for bodies
    that differ only in key order or spacing."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def hash_request_body(body: Any, endpoint: str = "") -> str:
    """``sha256:<hex>`` of the endpoint and the canonical JSON of the parsed body.

    Canonical: keys sorted, no insignificant whitespace, UTF-8; so two bodies that
    differ only in key order or spacing hash the same, and the same body sent to two
    endpoints does not.
    """
    return "sha256:" + hashlib.sha256(
        f"{endpoint}\n{canonical_json(body)}".encode("utf-8")).hexdigest()


class BeginOutcome(str, enum.Enum):
    NEW = "new"        # the caller runs the request
    REPLAY = "replay"  # the caller sends the stored response


@dataclass(frozen=True)
class BeginResult:
    """What ``begin`` decided; ``run_id`` identifies a NEW claim (pass it to complete/abandon)."""

    outcome: BeginOutcome
    response: Optional[CapturedResponse] = None  # set for REPLAY
    run_id: Optional[str] = None               # set for NEW


def _run_filter(request_id: Optional[str], run_id: Optional[str], params: list[Any]) -> str:
    """SQL that limits an in-progress record to the request / run whose ``begin`` made it
    (a record without that id matches); appends the ids to ``params``."""
    sql = ""
    if request_id is not None:
        sql += " AND (request_id IS NULL OR request_id = ?)"
        params.append(request_id)
    if run_id is not None:
        sql += " AND (run_id IS NULL OR run_id = ?)"
        params.append(run_id)
    return sql


class IdempotencyStore:
    """Idempotency records on SQLite; see the module docstring for the rules.

    Args:
        db_path: SQLite file (may be the ledger's).
        ttl_s: how long a completed response stays replayable.
        lease_s: how long an unfinished record blocks its key (default 3600 s).
        clock: wall-clock seconds (tests inject a fake one).
        synchronous: SQLite durability, as for BillingLedger.
        owner: this process's lease token (default: :func:`current_process`).
        reclaim: drop the in-progress records of dead owners now (start-up).
    """

    def __init__(self, db_path: "str | os.PathLike[str]", ttl_s: float = 86400.0,
                 lease_s: float = 3600.0, clock: Callable[[], float] = time.time,
                 synchronous: str = "FULL", owner: Optional[str] = None,
                 reclaim: bool = True) -> None:
        if not ttl_s > 0 or not lease_s > 0:
            raise ValueError(f"ttl_s and lease_s must be > 0, got {ttl_s}, {lease_s}")
        self.ttl_s = float(ttl_s)
        self.lease_s = float(lease_s)
        self.owner = owner or current_process().token
        self._clock = clock
        self._next_purge = 0.0
        self._db = SQLiteDatabase(db_path, synchronous=synchronous)
        with self._db.connection() as conn:
            conn.executescript(_SCHEMA)
            add_missing_columns(conn, "idempotency_keys", _ADDED_COLUMNS)
        if reclaim:
            self.reclaim_dead_owners()

    @property
    def path(self) -> str:
        return self._db.path

    def _reclaimable(self, row: sqlite3.Row, now: float) -> bool:
        """An in-progress record whose lease ran out or whose owner process is gone."""
        if row["expires_at"] <= now:
            return True
        return (row["state"] == "in_progress" and row["owner"] != self.owner
                and owner_is_dead(row["owner"]))

    def begin(self, tenant: str, key: str, body_hash: str, request_id: Optional[str] = None) -> BeginResult:
        """Claim ``(tenant, key)`` for a request whose canonical body hashes to ``body_hash``.

        Returns NEW with a fresh ``run_id`` (the caller runs it and must later
        ``complete`` or ``abandon``) or REPLAY with the stored response.

        Raises:
            IdempotencyConflict (409, ``Retry-After``): the same request with this key is
                still running.
            IdempotencyMismatch (422): the key was used with a different body.
        """
        validate_idempotency_key(key)
        now = self._clock()
        with self._db.transaction() as conn:
            if now >= self._next_purge:
                self._next_purge = now + PURGE_INTERVAL_S
                conn.execute("DELETE FROM idempotency_keys WHERE expires_at <= ?", (now,))
            row = conn.execute("SELECT * FROM idempotency_keys WHERE tenant = ? AND key = ?",
                               (tenant, key)).fetchone()
            if row is not None and self._reclaimable(row, now):
                if row["state"] == "in_progress":
                    logger.warning("idempotency key %r of tenant %s: request %s (owner %s) never "
                                   "finished; taking the key over", key, tenant, row["request_id"],
                                   row["owner"])
                conn.execute("DELETE FROM idempotency_keys WHERE tenant = ? AND key = ?", (tenant, key))
                row = None
            if row is None:
                run_id = uuid.uuid4().hex
                conn.execute(
                    "INSERT INTO idempotency_keys (tenant, key, body_hash, state, request_id, created_at, "
                    "expires_at, run_id, owner) VALUES (?, ?, ?, 'in_progress', ?, ?, ?, ?, ?)",
                    (tenant, key, body_hash, request_id, now, now + self.lease_s, run_id, self.owner),
                )
                return BeginResult(BeginOutcome.NEW, run_id=run_id)
        if row["body_hash"] != body_hash:
            raise IdempotencyMismatch()
        if row["state"] == "in_progress":
            raise IdempotencyConflict(retry_after=CONFLICT_RETRY_AFTER_S)
        return BeginResult(BeginOutcome.REPLAY, CapturedResponse(
            status=row["status"],
            headers=json.loads(row["headers"] or "{}"),
            body=None if row["body"] is None else json.loads(row["body"]),
            events=None if row["events"] is None else json.loads(row["events"]),
            request_id=row["request_id"],
        ))

    def complete(self, tenant: str, key: str, status: int, *, body: Any = None,
                 events: Optional[Sequence[str]] = None, headers: Optional[Mapping[str, str]] = None,
                 request_id: Optional[str] = None, run_id: Optional[str] = None,
                 also: Optional[Callable[[sqlite3.Connection], Any]] = None) -> bool:
        """Store the response of the NEW request holding ``(tenant, key)``.

        Give exactly one of ``body`` (a JSON-serialisable value) or ``events`` (the SSE
        ``data:`` payloads, in order, e.g. ``['{"id":...}', ..., '[DONE]']``). ``headers``
        is the subset to replay (e.g. Content-Type, X-Request-Id, X-Served-By). With
        ``run_id`` (or ``request_id``), only the record that ``begin`` created for that
        run (request) is completed. ``also(conn)`` runs first in the same transaction
        (it commits even when there is no record to complete). Returns False (and logs)
        when there is no such in-progress record.
        """
        if (body is None) == (events is None):
            raise ValueError("give exactly one of body or events")
        if events is not None and not all(isinstance(e, str) for e in events):
            raise ValueError("events must be strings (SSE data payloads)")
        now = self._clock()
        sql = ("UPDATE idempotency_keys SET state = 'completed', status = ?, headers = ?, body = ?, "
               "events = ?, completed_at = ?, expires_at = ?, request_id = COALESCE(?, request_id) "
               "WHERE tenant = ? AND key = ? AND state = 'in_progress'")
        params: list[Any] = [
            int(status), json.dumps(dict(headers or {})),
            None if body is None else json.dumps(body, allow_nan=False),
            None if events is None else json.dumps(list(events)),
            now, now + self.ttl_s, request_id, tenant, key,
        ]
        sql += _run_filter(request_id, run_id, params)
        with self._db.transaction() as conn:
            if also is not None:
                also(conn)
            done = conn.execute(sql, params).rowcount == 1
        if not done:
            logger.warning("idempotency key %r of tenant %s: no in-progress record to complete",
                           key, tenant)
        return done

    def abandon(self, tenant: str, key: str, request_id: Optional[str] = None,
                run_id: Optional[str] = None) -> bool:
        """Drop an in-progress record so a retry with the key runs; False if there was none.

        Completed records are never dropped. With ``run_id`` (or ``request_id``), only
        that run's (request's) record.
        """
        sql = "DELETE FROM idempotency_keys WHERE tenant = ? AND key = ? AND state = 'in_progress'"
        params: list[Any] = [tenant, key]
        sql += _run_filter(request_id, run_id, params)
        with self._db.transaction() as conn:
            return conn.execute(sql, params).rowcount == 1

    def reclaim_dead_owners(self) -> int:
        """Drop the in-progress records whose owner process is certainly dead (a server
        killed while they ran), so their keys run again at once; returns how many."""
        with self._db.transaction() as conn:
            rows = conn.execute("SELECT tenant, key, request_id, owner FROM idempotency_keys "
                                "WHERE state = 'in_progress' AND owner IS NOT NULL AND owner != ?",
                                (self.owner,)).fetchall()
            dead = [r for r in rows if owner_is_dead(r["owner"])]
            for r in dead:
                conn.execute("DELETE FROM idempotency_keys WHERE tenant = ? AND key = ? "
                             "AND state = 'in_progress' AND owner = ?", (r["tenant"], r["key"], r["owner"]))
        for r in dead:
            logger.warning("idempotency key %r of tenant %s: its request %s died with process %s; "
                           "the key is free again", r["key"], r["tenant"], r["request_id"], r["owner"])
        return len(dead)

    def purge_expired(self) -> int:
        """Delete expired records (completed past ttl, in-progress past lease); returns how many."""
        with self._db.transaction() as conn:
            return conn.execute("DELETE FROM idempotency_keys WHERE expires_at <= ?",
                                (self._clock(),)).rowcount

    def close(self) -> None:
        self._db.close()


class PeriodicTask:
    """Call ``fn()`` every ``interval_s`` seconds on a daemon thread until ``stop()``.

    The gateway runs :meth:`IdempotencyStore.purge_expired` with it (every 60 s by
    default), so expired records -- stored responses past their TTL, leases that ran
    out -- leave the database even when no request arrives. A failing call is logged
    and the next one still runs.
    """

    def __init__(self, fn: Callable[[], Any], interval_s: float, name: str) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.fn = fn
        self.interval_s = float(interval_s)
        self.runs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> "PeriodicTask":
        """Start the thread (the first call comes after one interval)."""
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                result = self.fn()
            except Exception:  # noqa: BLE001 - keep the upkeep going
                logger.exception("periodic task %s failed", self._thread.name)
            else:
                if result:
                    logger.info("periodic task %s: %s", self._thread.name, result)
            self.runs += 1

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for a running call to end."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
