"""Config sections of the caches and of cache operations (see docs/CACHING.md):

* ``admin: {keys: ["sha256:..."]}`` -- the admin API keys (hashes, as tenant keys);
* ``response_cache: {max_entries, max_bytes, ttl_s, store: sqlite | memory}`` -- bounds
  of the response cache; a tenant opts in with ``response_cache: true``;
* ``prompt_bundles: {pinned_blocks_per_tenant, max_bundles_per_tenant, max_versions}``
  -- the default pinning budget (a tenant may set its own ``bundle_pinned_blocks``);
* ``cache_audit: {sample_rate}`` -- share of prefix-cache hits the engine logs.

Parsed by :mod:`llmserve.gateway.config.gateway_config` with the strict validators of
:mod:`llmserve.gateway.config.fields`. No torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from llmserve.gateway.config.fields import Section, kind, positive_int, positive_number, string, string_list

_KEY_HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class AdminConfig:
    """Who may call the admin endpoints (flush, stats, shared prompt bundles)."""

    key_hashes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ResponseCacheConfig:
    """Bounds of the response cache (used only by tenants with ``response_cache: true``)."""

    max_entries: int = 10000
    max_bytes: int = 256 * 1024 * 1024
    ttl_s: float = 3600.0
    store: str = "sqlite"         # "sqlite" (the gateway database) or "memory"


@dataclass(frozen=True)
class PromptBundleConfig:
    """Limits of prompt bundles."""

    pinned_blocks_per_tenant: int = 256   # default KV pinning budget of a tenant
    max_bundles_per_tenant: int = 64      # bundle names per tenant (and shared)
    max_versions: int = 16                # versions kept per name (oldest dropped beyond)


@dataclass(frozen=True)
class CacheAuditConfig:
    sample_rate: float = 0.01             # share of prefix-cache hits logged by the engine


def key_hashes(value: Any, path: str, *, required: bool = True) -> tuple[str, ...]:
    """A list of ``sha256:<64 hex>`` key hashes (normalized), no duplicates."""
    raw = string_list(value, path) if value is not None else []
    if required and not raw:
        raise ValueError(f"{path}: required, a non-empty list of \"sha256:<hex>\" key hashes")
    out: list[str] = []
    for i, key_hash in enumerate(raw):
        normal = key_hash.strip().lower()
        if not _KEY_HASH_RE.match(normal):
            raise ValueError(f"{path}[{i}]: expected \"sha256:<64 hex digits>\" "
                             "(`llmserve keys hash KEY` prints it); plain keys are not accepted")
        if normal in out:
            raise ValueError(f"{path}[{i}]: duplicate key")
        out.append(normal)
    return tuple(out)


def sample_rate(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}: expected a number, got {kind(value)}")
    if not 0 <= value <= 1:
        raise ValueError(f"{path}: must be in [0, 1], got {value}")
    return float(value)


def parse_admin(data: Optional[Mapping]) -> Optional[AdminConfig]:
    if data is None:
        return None
    section = Section(data, "admin")
    hashes = key_hashes(section.data.get("keys"), "admin.keys")
    section.seen.add("keys")
    section.finish()
    return AdminConfig(key_hashes=hashes)


def parse_response_cache(data: Optional[Mapping]) -> ResponseCacheConfig:
    default = ResponseCacheConfig()
    if data is None:
        return default
    section = Section(data, "response_cache")
    store = section.take("store", string, default.store)
    if store not in ("sqlite", "memory"):
        raise ValueError(f"response_cache.store: expected 'sqlite' or 'memory', got {store!r}")
    config = ResponseCacheConfig(
        max_entries=section.take("max_entries", positive_int, default.max_entries),
        max_bytes=section.take("max_bytes", positive_int, default.max_bytes),
        ttl_s=section.take("ttl_s", positive_number, default.ttl_s),
        store=store)
    section.finish()
    return config


def parse_prompt_bundles(data: Optional[Mapping]) -> PromptBundleConfig:
    default = PromptBundleConfig()
    if data is None:
        return default
    section = Section(data, "prompt_bundles")
    budget = section.data.get("pinned_blocks_per_tenant")
    section.seen.add("pinned_blocks_per_tenant")
    config = PromptBundleConfig(
        pinned_blocks_per_tenant=default.pinned_blocks_per_tenant if budget is None
        else non_negative_int(budget, "prompt_bundles.pinned_blocks_per_tenant"),
        max_bundles_per_tenant=section.take("max_bundles_per_tenant", positive_int,
                                            default.max_bundles_per_tenant),
        max_versions=section.take("max_versions", positive_int, default.max_versions))
    section.finish()
    return config


def parse_cache_audit(data: Optional[Mapping]) -> CacheAuditConfig:
    if data is None:
        return CacheAuditConfig()
    section = Section(data, "cache_audit")
    config = CacheAuditConfig(sample_rate=section.take("sample_rate", sample_rate,
                                                       CacheAuditConfig().sample_rate))
    section.finish()
    return config


def non_negative_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path}: expected an integer, got {kind(value)}")
    if value < 0:
        raise ValueError(f"{path}: must be at least 0, got {value}")
    return value
