"""The response cache: a whole answer reused for an identical deterministic request.

Who and what (docs/CACHING.md has the full table):

* off by default; a tenant opts in with ``response_cache: true``; bounds under the
  top-level ``response_cache`` section (entries, bytes, TTL, sqlite or memory store);
* **key** = sha256 of the engine fingerprint (weights, quantization, tokenizer, chat
  template, engine version: any change misses by construction), the tenant (never
  shared between tenants, even ones sharing a prefix-cache namespace), the endpoint,
  the prompt bundle as resolved (``scope/name@version``) and the canonical body: every
  field that can change the answer or its bytes -- messages or prompt, every sampling
  parameter, max_tokens, stop, response_format, tools, logprobs, ``stream`` and
  ``stream_options`` (a streamed and a plain answer are stored apart) -- with keys
  sorted; ``user``, ``priority`` and ``cache`` are left out (they never change it);
* **cacheable** only when deterministic: ``temperature: 0`` or an explicit ``seed``;
  ``n > 1`` only with a seed; never with ``"cache": false`` or ``Cache-Control:
  no-store`` (``no-cache`` skips the lookup but stores the fresh answer);
* only a complete 200 answer of the requested model (no fallback) whose choices all
  ended with ``stop`` or ``length`` is stored.

No torch.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from llmserve.gateway.billing.idempotency import canonical_json
from llmserve.gateway.caches.response_store import CachedResponse, MemoryResponseStore, SQLiteResponseStore, StoreBounds
from llmserve.gateway.config.caches import ResponseCacheConfig

logger = logging.getLogger(__name__)

CACHE_HEADER = "X-Cache"
#: Body fields that never change the answer: left out of the key.
IGNORED_FIELDS = frozenset({"user", "priority", "cache", "prompt_bundle"})
#: Finish reasons of an answer worth storing.
STORABLE_FINISH = frozenset({"stop", "length"})

Store = Union[MemoryResponseStore, SQLiteResponseStore]


@dataclass(frozen=True)
class CacheDecision:
    """Whether to look the request up and whether to store its answer; ``reason`` says
    why not ("" when both)."""

    lookup: bool
    store: bool
    reason: str = ""

    @property
    def cacheable(self) -> bool:
        return self.lookup or self.store


def _cache_control(headers: Mapping[str, str]) -> set[str]:
    raw = headers.get("cache-control", "")
    return {part.strip().lower().split("=", 1)[0] for part in raw.split(",") if part.strip()}


def decide(body: Mapping[str, Any], headers: Mapping[str, str]) -> CacheDecision:
    """The response-cache decision for one parsed request body (see the module docstring)."""
    directives = _cache_control(headers)
    if body.get("cache") is False:
        return CacheDecision(False, False, "opt_out")
    if "no-store" in directives:
        return CacheDecision(False, False, "no_store")
    seed = body.get("seed")
    temperature = body.get("temperature")
    n = body.get("n") or 1
    if seed is None and temperature != 0:
        return CacheDecision(False, False, "nondeterministic")
    if n > 1 and seed is None:
        return CacheDecision(False, False, "nondeterministic")
    if "no-cache" in directives:
        return CacheDecision(False, True, "no_cache")
    return CacheDecision(True, True)


def cache_key(*, fingerprint: str, tenant: str, endpoint: str, body: Mapping[str, Any],
              bundle: Optional[str] = None) -> str:
    """``rc:<sha256>`` of everything that determines the answer (module docstring)."""
    kept = {k: v for k, v in body.items() if k not in IGNORED_FIELDS}
    blob = canonical_json({"v": 1, "fingerprint": fingerprint, "tenant": tenant,
                           "endpoint": endpoint, "bundle": bundle, "body": kept})
    return "rc:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ResponseCache:
    """The store plus hit/miss/store counters by tenant (for /metrics and admin stats)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, str], int] = {}   # (tenant, result) -> requests

    @classmethod
    def build(cls, config: ResponseCacheConfig, database: Optional[str]) -> "ResponseCache":
        bounds = StoreBounds(config.max_entries, config.max_bytes, config.ttl_s)
        if config.store == "sqlite":
            if database is None:
                raise ValueError("response_cache.store 'sqlite' needs a `database`")
            return cls(SQLiteResponseStore(database, bounds))
        return cls(MemoryResponseStore(bounds))

    def count(self, tenant: str, result: str) -> None:
        """Count one request: result is hit, miss, stored, or bypass."""
        with self._lock:
            self.counts[(tenant, result)] = self.counts.get((tenant, result), 0) + 1

    def get(self, key: str) -> Optional[CachedResponse]:
        """The live entry for ``key`` (blocking); a failing store is a miss."""
        try:
            return self.store.get(key)
        except Exception:  # noqa: BLE001 - the cache must never fail a request
            logger.exception("response cache lookup failed")
            return None

    def put(self, entry: CachedResponse) -> bool:
        """Store an answer (blocking); a failing store is logged and ignored."""
        try:
            return self.store.put(entry)
        except Exception:  # noqa: BLE001
            logger.exception("response cache store failed")
            return False

    def snapshot(self) -> dict[str, Any]:
        """Entries, bytes, evictions and per-tenant counters (JSON-ready)."""
        entries, size = self.store.usage()
        with self._lock:
            by_tenant: dict[str, dict[str, int]] = {}
            for (tenant, result), n in self.counts.items():
                by_tenant.setdefault(tenant, {})[result] = n
        return {"entries": entries, "bytes": size, "evictions": self.store.evictions,
                "by_tenant": by_tenant}

    def close(self) -> None:
        self.store.close()
