"""Where releases leave their records: the audit log of split changes, the current split
(so a rollback survives a restart) and the shadow comparisons.

Tables in the gateway's SQLite ``database``:

* ``release_audit``: one row per change -- when, who (``admin:<key hash prefix>`` or
  ``auto``), the public model, the action (``promote``, ``rollback``, ``set_share``,
  ``set_shadow``, ``auto_rollback``), the reason, the split before and after (JSON);
* ``release_state``: the live split per public model, with a hash of that model's
  config section: on start the stored split is used only while the section is
  unchanged (editing the config wins);
* ``shadow_comparisons``: one row per mirrored request -- the served and the shadow
  release, exact match, token agreement and both answers' token counts.

Without a database everything stays in memory (lost at restart). Blocking: call from
worker threads in async code. No torch.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from llmserve.gateway.sqlite_db import SQLiteDatabase

_SCHEMA = """
CREATE TABLE IF NOT EXISTS release_audit (
    event_id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    actor TEXT NOT NULL,
    model TEXT NOT NULL,
    action TEXT NOT NULL,
    reason TEXT,
    before TEXT NOT NULL,
    after TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS release_state (
    model TEXT PRIMARY KEY,
    config_hash TEXT NOT NULL,
    state TEXT NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS shadow_comparisons (
    comparison_id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    request_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    served_release TEXT NOT NULL,
    shadow_release TEXT NOT NULL,
    shadow_fingerprint TEXT NOT NULL,
    exact_match INTEGER NOT NULL,
    token_agreement REAL NOT NULL,
    served_tokens INTEGER NOT NULL,
    shadow_tokens INTEGER NOT NULL,
    error TEXT
);
"""

_AUDIT_COLUMNS = ("event_id", "at", "actor", "model", "action", "reason", "before", "after")
_SHADOW_COLUMNS = ("request_id", "tenant", "model", "served_release", "shadow_release",
                   "shadow_fingerprint", "exact_match", "token_agreement", "served_tokens",
                   "shadow_tokens", "error")


@dataclass(frozen=True)
class ShadowComparison:
    """How one mirrored request's shadow answer compared with the answer served."""

    request_id: str
    tenant: str
    model: str
    served_release: str
    shadow_release: str
    shadow_fingerprint: str
    exact_match: bool
    token_agreement: float
    served_tokens: int
    shadow_tokens: int
    error: Optional[str] = None


class ReleaseStore:
    """The three record kinds of the module docstring, in SQLite or in memory."""

    def __init__(self, path: Optional[str] = None) -> None:
        self._db = SQLiteDatabase(path) if path else None
        self._lock = threading.Lock()
        self._audit: list[dict[str, Any]] = []
        self._state: dict[str, tuple[str, dict[str, Any]]] = {}
        self._shadow: list[dict[str, Any]] = []
        if self._db is not None:
            with self._db.connection() as conn:
                conn.executescript(_SCHEMA)

    def audit(self, actor: str, model: str, action: str, reason: Optional[str],
              before: dict[str, Any], after: dict[str, Any], config_hash: str) -> dict[str, Any]:
        """Record one change and the model's new split (one transaction); returns the row."""
        row = {"at": time.time(), "actor": actor, "model": model, "action": action,
               "reason": reason, "before": json.dumps(before, sort_keys=True),
               "after": json.dumps(after, sort_keys=True)}
        state = row["after"]
        if self._db is None:
            with self._lock:
                row["event_id"] = len(self._audit) + 1
                self._audit.append(row)
                self._state[model] = (config_hash, after)
            return self._decode(row)
        with self._db.transaction() as conn:
            cur = conn.execute(
                "INSERT INTO release_audit (at, actor, model, action, reason, before, after) "
                "VALUES (:at, :actor, :model, :action, :reason, :before, :after)", row)
            row["event_id"] = cur.lastrowid
            conn.execute("INSERT INTO release_state (model, config_hash, state, updated_at) "
                         "VALUES (?, ?, ?, ?) ON CONFLICT(model) DO UPDATE SET "
                         "config_hash = excluded.config_hash, state = excluded.state, "
                         "updated_at = excluded.updated_at",
                         (model, config_hash, state, row["at"]))
        return self._decode(row)

    @staticmethod
    def _decode(row: Any) -> dict[str, Any]:
        out = {k: row[k] for k in _AUDIT_COLUMNS}
        out["before"], out["after"] = json.loads(out["before"]), json.loads(out["after"])
        return out

    def audit_log(self, model: Optional[str] = None, limit: int = 100) -> list[dict[str, Any]]:
        """The latest ``limit`` changes (of one model), oldest first."""
        if self._db is None:
            with self._lock:
                rows = [r for r in self._audit if model is None or r["model"] == model]
            return [self._decode(r) for r in rows[-limit:]]
        where, params = ("WHERE model = ?", [model]) if model is not None else ("", [])
        with self._db.connection() as conn:
            rows = conn.execute(f"SELECT {', '.join(_AUDIT_COLUMNS)} FROM release_audit {where} "
                                "ORDER BY event_id DESC LIMIT ?", [*params, limit]).fetchall()
        return [self._decode(r) for r in reversed(rows)]

    def stored_state(self, model: str, config_hash: str) -> Optional[dict[str, Any]]:
        """The split last stored for ``model`` if its config section is unchanged."""
        if self._db is None:
            with self._lock:
                found = self._state.get(model)
            return found[1] if found and found[0] == config_hash else None
        with self._db.connection() as conn:
            row = conn.execute("SELECT config_hash, state FROM release_state WHERE model = ?",
                               (model,)).fetchone()
        if row is None or row["config_hash"] != config_hash:
            return None
        return json.loads(row["state"])

    def record_shadow(self, comparison: ShadowComparison) -> None:
        """Append one shadow comparison."""
        row = {k: getattr(comparison, k) for k in _SHADOW_COLUMNS}
        row["exact_match"] = int(comparison.exact_match)
        row["at"] = time.time()
        if self._db is None:
            with self._lock:
                self._shadow.append(row)
            return
        with self._db.connection() as conn:
            conn.execute(f"INSERT INTO shadow_comparisons (at, {', '.join(_SHADOW_COLUMNS)}) "
                         f"VALUES (:at, {', '.join(':' + c for c in _SHADOW_COLUMNS)})", row)

    def shadow_log(self, model: Optional[str] = None, limit: int = 100) -> list[dict[str, Any]]:
        """The latest ``limit`` shadow comparisons (of one model), oldest first."""
        if self._db is None:
            with self._lock:
                rows = [r for r in self._shadow if model is None or r["model"] == model]
            return [dict(r) for r in rows[-limit:]]
        where, params = ("WHERE model = ?", [model]) if model is not None else ("", [])
        with self._db.connection() as conn:
            rows = conn.execute(f"SELECT * FROM shadow_comparisons {where} "
                                "ORDER BY comparison_id DESC LIMIT ?", [*params, limit]).fetchall()
        return [dict(r) for r in reversed(rows)]

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
