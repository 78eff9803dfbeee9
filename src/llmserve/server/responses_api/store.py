"""Stored responses (``store: true``) in SQLite, per tenant, for a limited time.

One row per (tenant, response id): the response object as it was returned, the input
items it was given, and its conversation as chat messages (every earlier turn the
``previous_response_id`` chain carried, this request's input and this response's
output; instructions excluded, as OpenAI does). A later request names it in
``previous_response_id`` to continue the conversation; ``GET`` and ``DELETE
/v1/responses/{id}`` read and remove it. A tenant never sees another tenant's
responses (without a gateway every caller is the tenant ``""``).

Rows expire ``ttl_s`` seconds after they were written (default 30 days, OpenAI's
retention) and are purged on writes. The default database is in memory (the server's
lifetime); ``--responses-store PATH`` keeps them in a file across restarts. Calls block
briefly on one connection behind a lock; the async methods run them on a thread. No torch.
"""
from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

#: Stored responses live this long by default (seconds): 30 days.
DEFAULT_TTL_S = 30 * 24 * 3600.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    conversation TEXT NOT NULL,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires_at);
"""


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: the object returned, its input items, its conversation."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """The SQLite store of responses (see the module docstring)."""

    def __init__(self, path: str = ":memory:", ttl_s: float = DEFAULT_TTL_S) -> None:
        if not ttl_s > 0:
            raise ValueError(f"the responses TTL must be > 0 seconds, got {ttl_s!r}")
        self.path = path
        self.ttl_s = float(ttl_s)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            if path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise ValueError(f"cannot open the responses store {path!r}: {exc}") from None

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()

    def put(self, tenant: str, record: StoredResponse, now: Optional[float] = None) -> None:
        """Store (or replace: an idempotent replay stores the same response again) one
        response, and purge expired rows."""
        now = time.time() if now is None else now
        row = (tenant, record.response["id"], now, now + self.ttl_s,
               json.dumps(record.response, ensure_ascii=False),
               json.dumps(record.input_items, ensure_ascii=False),
               json.dumps(record.conversation, ensure_ascii=False))
        with self._lock:
            self._db.execute("DELETE FROM responses WHERE expires_at <= ?", (now,))
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                             row)

    def get(self, tenant: str, resp_id: str, now: Optional[float] = None
            ) -> Optional[StoredResponse]:
        """The tenant's stored response ``resp_id``, or None (absent, expired, another
        tenant's)."""
        now = time.time() if now is None else now
        with self._lock:
            row = self._db.execute(
                "SELECT response, input_items, conversation FROM responses "
                "WHERE tenant = ? AND id = ? AND expires_at > ?", (tenant, resp_id, now)
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]), json.loads(row[2]))

    def delete(self, tenant: str, resp_id: str) -> bool:
        """Remove the tenant's response ``resp_id``; False when there was none."""
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?",
                                   (tenant, resp_id))
        return cur.rowcount > 0

    def count(self) -> int:
        """Rows stored (expired ones not yet purged included)."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    async def aput(self, tenant: str, record: StoredResponse) -> None:
        """:meth:`put` on a thread."""
        await asyncio.to_thread(self.put, tenant, record)

    async def aget(self, tenant: str, resp_id: str) -> Optional[StoredResponse]:
        """:meth:`get` on a thread."""
        return await asyncio.to_thread(self.get, tenant, resp_id)

    async def adelete(self, tenant: str, resp_id: str) -> bool:
        """:meth:`delete` on a thread."""
        return await asyncio.to_thread(self.delete, tenant, resp_id)
