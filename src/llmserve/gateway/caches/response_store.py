"""Where the response cache keeps its entries: SQLite (the gateway database) or memory.

Both stores bound the cache by entries and bytes (an entry's size is the length of its
stored JSON) and expire entries ``ttl_s`` seconds after they were stored; over a bound,
the least recently used entries go first. An entry larger than ``max_bytes`` is not
stored. Thread-safe and blocking (call from a worker thread in async code). No torch.
"""
from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

from llmserve.contract.gateway_hook import CapturedResponse
from llmserve.gateway.sqlite_db import SQLiteDatabase

_SCHEMA = """
CREATE TABLE IF NOT EXISTS response_cache (
    key TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    entry TEXT NOT NULL,
    size INTEGER NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    last_used REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS response_cache_last_used ON response_cache (last_used);
CREATE INDEX IF NOT EXISTS response_cache_tenant ON response_cache (tenant);
"""


@dataclass(frozen=True)
class CachedResponse:
    """A stored answer: the response as sent (:class:`CapturedResponse`: JSON ``body`` or
    SSE ``events``) and the usage it reported (what a hit bills)."""

    key: str
    tenant: str
    response: CapturedResponse
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"
    fingerprint: str = ""
    served_model: str = ""
    created_at: float = 0.0

    def to_json(self) -> str:
        """One flat JSON object (the stored form: the response's fields beside the usage)."""
        r = self.response
        return json.dumps({"key": self.key, "tenant": self.tenant, "status": r.status,
                           "headers": r.headers, "body": r.body, "events": r.events,
                           "prompt_tokens": self.prompt_tokens,
                           "completion_tokens": self.completion_tokens,
                           "finish_reason": self.finish_reason, "fingerprint": self.fingerprint,
                           "served_model": self.served_model, "created_at": self.created_at},
                          separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> "CachedResponse":
        """The entry :meth:`to_json` wrote."""
        d = json.loads(text)
        response = CapturedResponse(d.pop("status"), d.pop("headers", {}), body=d.pop("body", None),
                                    events=d.pop("events", None), replay_kind="cache")
        return cls(response=response, **d)


@dataclass(frozen=True)
class StoreBounds:
    max_entries: int
    max_bytes: int
    ttl_s: float

    def encode(self, entry: CachedResponse) -> Optional[tuple[str, int]]:
        """The entry's stored JSON and its size, or None when it exceeds ``max_bytes``."""
        text = entry.to_json()
        size = len(text.encode("utf-8"))
        return None if size > self.max_bytes else (text, size)


class _BoundedStore(ABC):
    """What both stores share: ``put`` encodes an entry and refuses one over the bounds."""

    bounds: StoreBounds
    _clock: Callable[[], float]

    def put(self, entry: CachedResponse) -> bool:
        """Store ``entry`` (replacing one with its key, evicting LRU entries over the bounds);
        False when it alone is larger than ``max_bytes``."""
        encoded = self.bounds.encode(entry)
        if encoded is None:
            return False
        text, size = encoded
        self._store(entry, text, size, self._clock())
        return True

    @abstractmethod
    def _store(self, entry: CachedResponse, text: str, size: int, now: float) -> None:
        """Keep ``entry`` as ``text`` (``size`` bytes) from ``now`` on, then evict."""


class MemoryResponseStore(_BoundedStore):
    """Entries in an LRU dict (lost at restart)."""

    def __init__(self, bounds: StoreBounds, clock: Callable[[], float] = time.time) -> None:
        self.bounds = bounds
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: "OrderedDict[str, tuple[str, int, float]]" = OrderedDict()  # json, size, exp
        self._bytes = 0
        self.evictions = 0

    def get(self, key: str) -> Optional[CachedResponse]:
        now = self._clock()
        with self._lock:
            item = self._entries.get(key)
            if item is None:
                return None
            if item[2] <= now:
                self._drop(key)
                return None
            self._entries.move_to_end(key)
        return CachedResponse.from_json(item[0])

    def _store(self, entry: CachedResponse, text: str, size: int, now: float) -> None:
        with self._lock:
            if entry.key in self._entries:
                self._drop(entry.key)
            self._entries[entry.key] = (text, size, now + self.bounds.ttl_s)
            self._bytes += size
            while (len(self._entries) > self.bounds.max_entries
                   or self._bytes > self.bounds.max_bytes):
                self._drop(next(iter(self._entries)))
                self.evictions += 1

    def _drop(self, key: str) -> None:
        _text, size, _exp = self._entries.pop(key)
        self._bytes -= size

    def flush(self, tenant: Optional[str] = None) -> int:
        """Drop every entry, or one tenant's; returns how many."""
        with self._lock:
            keys = [k for k, (text, _s, _e) in self._entries.items()
                    if tenant is None or json.loads(text)["tenant"] == tenant]
            for k in keys:
                self._drop(k)
        return len(keys)

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) held now."""
        with self._lock:
            return len(self._entries), self._bytes

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


class SQLiteResponseStore(_BoundedStore):
    """Entries in the ``response_cache`` table of the gateway database (survive restarts)."""

    def __init__(self, db_path: str, bounds: StoreBounds, clock: Callable[[], float] = time.time,
                 synchronous: str = "NORMAL") -> None:
        self.bounds = bounds
        self._clock = clock
        self._db = SQLiteDatabase(db_path, synchronous=synchronous)
        self.evictions = 0
        with self._db.connection() as conn:
            conn.executescript(_SCHEMA)

    def get(self, key: str) -> Optional[CachedResponse]:
        now = self._clock()
        with self._db.connection() as conn:
            row = conn.execute("SELECT entry, expires_at FROM response_cache WHERE key = ?",
                               (key,)).fetchone()
            if row is None:
                return None
            if row["expires_at"] <= now:
                conn.execute("DELETE FROM response_cache WHERE key = ? AND expires_at <= ?",
                             (key, now))
                return None
            conn.execute("UPDATE response_cache SET last_used = ? WHERE key = ?", (now, key))
        return CachedResponse.from_json(row["entry"])

    def _store(self, entry: CachedResponse, text: str, size: int, now: float) -> None:
        with self._db.transaction() as conn:
            conn.execute("DELETE FROM response_cache WHERE expires_at <= ?", (now,))
            conn.execute("INSERT OR REPLACE INTO response_cache (key, tenant, entry, size, "
                         "created_at, expires_at, last_used) VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (entry.key, entry.tenant, text, size, now, now + self.bounds.ttl_s, now))
            count, total = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM response_cache").fetchone()
            if count > self.bounds.max_entries or total > self.bounds.max_bytes:
                for row in conn.execute("SELECT key, size FROM response_cache WHERE key != ? "
                                        "ORDER BY last_used, created_at", (entry.key,)).fetchall():
                    if count <= self.bounds.max_entries and total <= self.bounds.max_bytes:
                        break
                    conn.execute("DELETE FROM response_cache WHERE key = ?", (row["key"],))
                    count, total = count - 1, total - row["size"]
                    self.evictions += 1

    def flush(self, tenant: Optional[str] = None) -> int:
        with self._db.transaction() as conn:
            if tenant is None:
                return conn.execute("DELETE FROM response_cache").rowcount
            return conn.execute("DELETE FROM response_cache WHERE tenant = ?", (tenant,)).rowcount

    def usage(self) -> tuple[int, int]:
        with self._db.connection() as conn:
            count, total = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM response_cache WHERE expires_at > ?",
                (self._clock(),)).fetchone()
        return int(count), int(total)

    def close(self) -> None:
        self._db.close()
