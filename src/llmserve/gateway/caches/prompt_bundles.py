"""Prompt bundles: versioned, named system prompts / tool blocks a chat request references.

A bundle is owned by one tenant (``tenant:<name>``) or, when an admin key created it,
shared by all (``shared``). Each POST of a name adds a version (1, 2, ...); a version
number is never reused, even after the name was deleted, so a new version can never be
taken for an old one. A chat request names ``"prompt_bundle": "support@2"`` or
``"support"`` (the latest version); the tenant's own bundle of that name wins over a
shared one. Bundles live in memory or, with a gateway ``database``, in its
``prompt_bundles`` table (they survive restarts; their KV is then pinned again on
first use). Thread-safe; SQLite calls block. No torch.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from llmserve.gateway.config.fields import identifier
from llmserve.gateway.errors import GatewayError, InvalidRequest
from llmserve.gateway.sqlite_db import SQLiteDatabase

SHARED = "shared"
_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_BUNDLE_MESSAGES = 256
MAX_BUNDLE_BYTES = 256 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS prompt_bundles (
    owner TEXT NOT NULL, name TEXT NOT NULL, version INTEGER NOT NULL,
    messages TEXT NOT NULL, tools TEXT, created_at REAL NOT NULL,
    PRIMARY KEY (owner, name, version)
);
CREATE TABLE IF NOT EXISTS prompt_bundle_versions (
    owner TEXT NOT NULL, name TEXT NOT NULL, last_version INTEGER NOT NULL,
    PRIMARY KEY (owner, name)
);
"""


class BundleNotFound(GatewayError):
    """404: no prompt bundle of this name (and version) for the caller."""

    def __init__(self, message: str, param: Optional[str] = "prompt_bundle") -> None:
        super().__init__(404, message, "invalid_request_error", "prompt_bundle_not_found", param)


@dataclass(frozen=True)
class PromptBundle:
    """One version of a bundle."""

    owner: str                       # "tenant:<name>" or "shared"
    name: str
    version: int
    messages: tuple[dict[str, str], ...]
    tools: Optional[list[Any]] = None
    created_at: float = field(default_factory=time.time)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def bundle_id(self) -> str:
        """Unique over owners, names and versions: ``owner/name@version``."""
        return f"{self.owner}/{self.ref}"

    def cache_salt(self, tenant_salt: str) -> str:
        """The prefix-cache namespace of requests using this version: a sub-namespace of
        the tenant's, so versions never share KV and tenants never share a bundle's."""
        return f"{tenant_salt}|bundle:{self.bundle_id}"

    def describe(self) -> dict[str, Any]:
        return {"object": "prompt_bundle", "name": self.name, "version": self.version,
                "shared": self.owner == SHARED, "messages": list(self.messages),
                "tools": self.tools, "created_at": int(self.created_at)}


def parse_bundle_body(raw: bytes) -> tuple[str, list[dict[str, str]], Optional[list[Any]]]:
    """Validate a POST body ``{"name", "messages", "tools"?}``; raises InvalidRequest (400)."""
    if len(raw) > MAX_BUNDLE_BYTES:
        raise InvalidRequest(f"a prompt bundle may be at most {MAX_BUNDLE_BYTES} bytes")
    try:
        body = json.loads(raw or b"null")
    except ValueError as e:
        raise InvalidRequest(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("expected a JSON object {\"name\", \"messages\", \"tools\"}")
    unknown = sorted(set(body) - {"name", "messages", "tools"})
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}",
                             param=unknown[0], code="unknown_parameter")
    try:
        name = identifier(body.get("name"), "name")
    except ValueError as e:
        raise InvalidRequest(str(e), param="name") from None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_BUNDLE_MESSAGES:
        raise InvalidRequest(f"messages must be an array of 1-{MAX_BUNDLE_MESSAGES} messages",
                             param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise InvalidRequest(f"messages[{i}] must be {{\"role\", \"content\"}}",
                                 param=f"messages[{i}]")
        if m.get("role") not in _ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(_ROLES)}",
                                 param=f"messages[{i}].role")
        if not isinstance(m.get("content"), str):
            raise InvalidRequest(f"messages[{i}].content must be a string",
                                 param=f"messages[{i}].content")
        out.append({k: m[k] for k in ("role", "content", "name") if k in m})
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("tools must be an array", param="tools")
    return name, out, (tools or None)


def parse_ref(ref: Any) -> tuple[str, Optional[int]]:
    """``"name@3"`` -> ("name", 3); ``"name"`` -> ("name", None); 400 otherwise."""
    if not isinstance(ref, str) or not ref:
        raise InvalidRequest("prompt_bundle must be \"name\" or \"name@version\"",
                             param="prompt_bundle")
    name, sep, version = ref.partition("@")
    if sep and not (version.isdigit() and int(version) >= 1):
        raise InvalidRequest(f"prompt_bundle {ref!r}: the version must be a positive integer",
                             param="prompt_bundle")
    try:
        identifier(name, "prompt_bundle")
    except ValueError as e:
        raise InvalidRequest(str(e), param="prompt_bundle") from None
    return name, int(version) if sep else None


class BundleRegistry:
    """The bundles of one gateway (see the module docstring)."""

    def __init__(self, database: Optional[str] = None, max_versions: int = 16,
                 max_names: int = 64) -> None:
        self.max_versions = max_versions
        self.max_names = max_names
        self._lock = threading.Lock()
        self._bundles: dict[tuple[str, str], dict[int, PromptBundle]] = {}
        self._last: dict[tuple[str, str], int] = {}
        self._db = SQLiteDatabase(database) if database else None
        if self._db is not None:
            self._load()

    def _load(self) -> None:
        if self._db is None:
            return
        with self._db.connection() as conn:
            conn.executescript(_SCHEMA)
            for row in conn.execute("SELECT * FROM prompt_bundles ORDER BY version"):
                b = PromptBundle(row["owner"], row["name"], row["version"],
                                 tuple(json.loads(row["messages"])),
                                 json.loads(row["tools"]) if row["tools"] else None,
                                 row["created_at"])
                self._bundles.setdefault((b.owner, b.name), {})[b.version] = b
            for row in conn.execute("SELECT * FROM prompt_bundle_versions"):
                self._last[(row["owner"], row["name"])] = row["last_version"]

    def create(self, owner: str, name: str, messages: list[dict[str, str]],
               tools: Optional[list[Any]]) -> tuple[PromptBundle, list[PromptBundle]]:
        """Add a version; returns it and the old versions dropped past ``max_versions``."""
        with self._lock:
            key = (owner, name)
            names = sum(1 for (o, _n), v in self._bundles.items() if o == owner and v)
            if key not in self._bundles and names >= self.max_names:
                raise InvalidRequest(f"at most {self.max_names} prompt bundle names per owner",
                                     code="too_many_prompt_bundles")
            version = self._last.get(key, 0) + 1
            bundle = PromptBundle(owner, name, version, tuple(messages), tools)
            versions = self._bundles.setdefault(key, {})
            versions[version] = bundle
            dropped = [versions.pop(v) for v in sorted(versions)[:-self.max_versions]]
            self._last[key] = version
            if self._db is not None:
                with self._db.transaction() as conn:
                    conn.execute("INSERT INTO prompt_bundles VALUES (?, ?, ?, ?, ?, ?)",
                                 (owner, name, version, json.dumps(messages),
                                  json.dumps(tools) if tools else None, bundle.created_at))
                    conn.execute("INSERT INTO prompt_bundle_versions VALUES (?, ?, ?) ON CONFLICT "
                                 "(owner, name) DO UPDATE SET last_version = excluded.last_version",
                                 (owner, name, version))
                    for old in dropped:
                        conn.execute("DELETE FROM prompt_bundles WHERE owner = ? AND name = ? "
                                     "AND version = ?", (owner, name, old.version))
            return bundle, dropped

    def resolve(self, owners: list[str], ref: str) -> PromptBundle:
        """The bundle ``ref`` names, looked up in ``owners`` in order (404 if none)."""
        name, version = parse_ref(ref)
        with self._lock:
            for owner in owners:
                versions = self._bundles.get((owner, name))
                if not versions:
                    continue
                chosen = versions.get(version) if version is not None else versions[max(versions)]
                if chosen is not None:
                    return chosen
        raise BundleNotFound(f"prompt bundle {ref!r} does not exist", param="prompt_bundle")

    def versions(self, owner: str, name: str) -> list[PromptBundle]:
        with self._lock:
            return [b for _v, b in sorted(self._bundles.get((owner, name), {}).items())]

    def listing(self, owners: list[str]) -> list[PromptBundle]:
        """Every version of every bundle of these owners."""
        with self._lock:
            return [b for (owner, _n), versions in sorted(self._bundles.items())
                    if owner in owners for _v, b in sorted(versions.items())]

    def delete(self, owner: str, name: str, version: Optional[int] = None) -> list[PromptBundle]:
        """Remove one version or all of a name; returns what was removed."""
        with self._lock:
            versions = self._bundles.get((owner, name), {})
            chosen = [v for v in list(versions) if version is None or v == version]
            removed = [versions.pop(v) for v in chosen]
            if not versions:
                self._bundles.pop((owner, name), None)
            if self._db is not None and removed:
                with self._db.transaction() as conn:
                    for b in removed:
                        conn.execute("DELETE FROM prompt_bundles WHERE owner = ? AND name = ? "
                                     "AND version = ?", (owner, name, b.version))
            return removed

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
