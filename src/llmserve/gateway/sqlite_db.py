"""A small SQLite helper shared by the billing ledger and the idempotency store.

One database file in WAL mode (readers never block the writer), a pool of connections
so that threads never share one at the same time, and explicit transactions:
``BEGIN IMMEDIATE`` takes the write lock up front, so a read-then-write decision inside
it cannot race another thread or process. Both stores may use the same file.
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from pathlib import Path
from typing import Iterator


class SQLiteDatabase:
    """Connections to one SQLite file, safe to use from many threads.

    Args:
        path: the database file (created with its folder if missing). ``:memory:`` is
            refused: each pooled connection would see a different empty database.
        busy_timeout_s: how long a statement waits for another writer's lock.
        synchronous: SQLite ``PRAGMA synchronous``; FULL survives power loss, NORMAL
            only process crashes.
    """

    def __init__(self, path: "str | os.PathLike[str]", busy_timeout_s: float = 30.0,
                 synchronous: str = "FULL") -> None:
        if str(path) == ":memory:" or not str(path):
            raise ValueError("the gateway database must be a file path, not ':memory:'")
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")
        self.path = str(path)
        Path(self.path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self._busy_timeout_s = busy_timeout_s
        self._synchronous = synchronous.upper()
        self._lock = threading.Lock()
        self._idle: list[sqlite3.Connection] = []
        self._closed = False
        with self.connection() as conn:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise RuntimeError(f"{self.path}: could not switch SQLite to WAL mode (got {mode!r})")

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self._busy_timeout_s, isolation_level=None,
                               check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_s * 1000)}")
        conn.execute(f"PRAGMA synchronous={self._synchronous}")
        return conn

    @contextlib.contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        """Borrow a connection (autocommit mode) for the duration of the block."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.path}: database is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect()
        try:
            yield conn
        finally:
            with self._lock:
                if self._closed:
                    conn.close()
                else:
                    self._idle.append(conn)

    @contextlib.contextmanager
    def transaction(self, immediate: bool = True) -> Iterator[sqlite3.Connection]:
        """A transaction (``BEGIN IMMEDIATE`` by default): committed on success, rolled back on error."""
        with self.connection() as conn:
            conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def close(self) -> None:
        """Close idle connections now and borrowed ones when they come back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def add_missing_columns(conn: sqlite3.Connection, table: str, columns: dict[str, str]) -> None:
    """``ALTER TABLE ... ADD COLUMN`` each of ``columns`` (name -> declaration) that
    ``table`` lacks: brings a database written by an older version up to date."""
    present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
    for column, declaration in columns.items():
        if column not in present:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
