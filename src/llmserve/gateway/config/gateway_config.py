"""The gateway config file: tenants, API key hashes, limits, queue, fallback routes, releases.

``GatewayConfig.load(path)`` reads YAML (``.yaml``/``.yml``/anything else) or TOML
(``.toml``) and validates strictly: an unknown key, a wrong type or a malformed key hash
raises ``ValueError`` naming the place, e.g. ``tenants.acme.keys[0]: ...``.
Without a config file the server runs open: ``GatewayConfig.open_default()`` has one
tenant, ``default``, that needs no key and may use every model.

The full format is documented in docs/GATEWAY.md.
"""
from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Mapping, Optional

from llmserve.contract.names import check_name
from llmserve.contract.server_limits import ServerLimits
from llmserve.gateway.config.caches import (
    AdminConfig,
    CacheAuditConfig,
    PromptBundleConfig,
    ResponseCacheConfig,
    non_negative_int,
    parse_admin,
    parse_cache_audit,
    parse_prompt_bundles,
    parse_response_cache,
)
from llmserve.gateway.config.caches import key_hashes as parse_key_hashes
from llmserve.gateway.config.fields import (
    Section,
    boolean,
    fraction,
    identifier,
    mapping,
    parse_toml,
    positive_int,
    positive_number,
    string,
    string_list,
)
from llmserve.gateway.releases.config import ModelReleases, parse_releases
from llmserve.protocol import PRIORITY_CLASSES, priority_value

KEY_HASH_PREFIX = "sha256:"
OPEN_TENANT = "default"
#: Default ``max_tokens_reservation``: completion tokens reserved for a request without max_tokens.
DEFAULT_MAX_TOKENS_RESERVATION = 512


def hash_api_key(key: str) -> str:
    """The stored form of an API key: ``"sha256:" + hex(sha256(key))``."""
    if not isinstance(key, str) or not key:
        raise ValueError("an API key must be a non-empty string")
    return KEY_HASH_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_api_key() -> str:
    """A new random API key (``sk-`` + 43 URL-safe characters, 256 bits)."""
    return "sk-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class QueueConfig:
    """Bounds of the waiting queue (see llmserve.gateway.admission.controller)."""

    max_requests: int = 64       # requests waiting for the engine to start them
    max_tokens: int = 65536      # sum over waiting requests of prompt + max_tokens
    timeout_s: float = 30.0      # longest wait before a request is removed (503)
    kv_watermark: Optional[float] = 0.05  # share of the KV pool kept free; None: no KV gate


@dataclass(frozen=True)
class ModelRoute:
    """Routing for one served model name: the model to use when it is overloaded."""

    name: str
    fallback: Optional[str] = None


@dataclass(frozen=True)
class TenantConfig:
    """One tenant: who it is (key hashes) and what it may do."""

    name: str
    key_hashes: tuple[str, ...] = ()
    models: tuple[str, ...] = ("*",)            # fnmatch patterns, case-sensitive
    priority: str = "default"                   # a name in llmserve.protocol.PRIORITY_CLASSES
    requests_per_minute: Optional[int] = None   # None: unlimited
    tokens_per_minute: Optional[int] = None     # None: unlimited
    request_burst: Optional[int] = None         # request bucket size; None: requests_per_minute
    token_burst: Optional[int] = None           # token bucket size; None: tokens_per_minute
    allow_fallback: bool = False
    max_request_timeout_s: Optional[float] = None  # cap on X-Request-Timeout; None: no cap
    max_concurrent: Optional[int] = None        # requests in flight at once; None: unlimited
    shared_prefix: bool = False                 # opt in to a shared prefix-cache namespace
    cache_namespace: Optional[str] = None       # that namespace's name (default "public")
    response_cache: bool = False                # opt in to the response cache
    bundle_pinned_blocks: Optional[int] = None  # KV pinning budget; None: prompt_bundles' default

    def allows_model(self, model: str) -> bool:
        """True when ``model`` matches one of the tenant's ``models`` patterns."""
        return any(fnmatchcase(model, pattern) for pattern in self.models)

    @property
    def priority_rank(self) -> int:
        """The engine's integer priority for this tenant's requests (lower runs first)."""
        return priority_value(self.priority)

    @property
    def cache_salt(self) -> str:
        """The engine's prefix-cache salt for this tenant's requests.

        ``tenant:<name>`` keeps every tenant's cache entries private; a tenant with
        ``shared_prefix: true`` uses ``shared:<cache_namespace>`` instead, shared with
        the other tenants that opted in to the same namespace. The two prefixes keep a
        shared namespace from ever colliding with a tenant's private one.
        """
        if self.shared_prefix:
            return f"shared:{self.cache_namespace or 'public'}"
        return f"tenant:{self.name}"

    def effective_timeout(self, default_s: float, requested_s: Optional[float] = None) -> float:
        """The request's deadline in seconds: the header's value (if any) or the default,
        capped by this tenant's ``max_request_timeout_s`` or, for a tenant without one,
        by the default itself (``X-Request-Timeout`` can shorten the deadline, never
        stretch it past what the operator configured)."""
        timeout = default_s if requested_s is None else requested_s
        cap = self.max_request_timeout_s if self.max_request_timeout_s is not None else default_s
        return min(timeout, cap)


@dataclass(frozen=True)
class GatewayConfig:
    """The whole gateway config. ``auth_required`` is False only in open mode."""

    tenants: Mapping[str, TenantConfig]
    models: Mapping[str, ModelRoute] = field(default_factory=dict)
    queue: QueueConfig = QueueConfig()
    request_timeout_s: float = 120.0
    database: Optional[str] = None      # SQLite file for the ledger and idempotency keys
    idempotency_ttl_s: float = 86400.0
    auth_required: bool = True
    max_tokens_reservation: int = DEFAULT_MAX_TOKENS_RESERVATION  # per choice, without max_tokens
    server: ServerLimits = ServerLimits()
    admin: Optional[AdminConfig] = None          # None: no admin key, admin endpoints 403
    response_cache: ResponseCacheConfig = ResponseCacheConfig()
    prompt_bundles: PromptBundleConfig = PromptBundleConfig()
    cache_audit: CacheAuditConfig = CacheAuditConfig()
    releases: Mapping[str, ModelReleases] = field(default_factory=dict)  # public model -> releases
    #: `metrics: {per_tenant: true}`: /metrics carries per-tenant series (tenant and
    #: cache_namespace labels); off by default, /metrics needs no key (docs/METRICS.md)
    per_tenant_metrics: bool = False

    def bundle_budget(self, tenant: TenantConfig) -> int:
        """The tenant's KV pinning budget for prompt bundles, in blocks."""
        if tenant.bundle_pinned_blocks is not None:
            return tenant.bundle_pinned_blocks
        return self.prompt_bundles.pinned_blocks_per_tenant

    @classmethod
    def load(cls, path: "str | os.PathLike[str]") -> "GatewayConfig":
        """Read and validate a YAML or TOML (by ``.toml`` suffix) config file.

        A relative ``database`` path is resolved against the config file's folder.
        """
        p = Path(path)
        text = p.read_text(encoding="utf-8")
        if p.suffix.lower() == ".toml":
            try:
                data = parse_toml(text)
            except ValueError as e:
                raise ValueError(f"{p}: {e}") from e
        else:
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ValueError(f"{p}: not valid YAML: {e}") from e
        return cls.from_dict(data, base_dir=p.resolve().parent)

    @classmethod
    def from_dict(cls, data: Any, base_dir: "str | os.PathLike[str] | None" = None) -> "GatewayConfig":
        """Validate an already parsed config mapping (see :meth:`load`)."""
        root = Section(data, "")
        database = root.take("database", string, None)
        if database == ":memory:":
            raise ValueError("database: must be a file path (the ledger must survive restarts)")
        if database is not None and base_dir is not None:
            database = str(Path(base_dir) / Path(database).expanduser())
        queue = _parse_queue(root.take("queue", mapping, {}))
        request_timeout_s = root.take("request_timeout_s", positive_number, 120.0)
        idempotency_ttl_s = root.take("idempotency_ttl_s", positive_number, 86400.0)
        reservation = root.take("max_tokens_reservation", positive_int,
                                DEFAULT_MAX_TOKENS_RESERVATION)
        server = _parse_server(root.take("server", mapping, {}))
        models = _parse_models(root.take("models", mapping, {}))
        tenants = _parse_tenants(root.take("tenants", mapping, None))
        admin = parse_admin(root.take("admin", mapping, None))
        response_cache = parse_response_cache(root.take("response_cache", mapping, None))
        bundles = parse_prompt_bundles(root.take("prompt_bundles", mapping, None))
        audit = parse_cache_audit(root.take("cache_audit", mapping, None))
        releases = parse_releases(root.take("releases", mapping, None), tenants)
        metrics = Section(root.take("metrics", mapping, {}), "metrics")
        per_tenant_metrics = metrics.take("per_tenant", boolean, False)
        metrics.finish()
        root.finish()
        if response_cache.store == "sqlite" and database is None and any(
                t.response_cache for t in tenants.values()):
            raise ValueError("response_cache.store: 'sqlite' needs a `database` "
                             "(or set store: memory)")
        if admin is not None:
            taken = {h: t.name for t in tenants.values() for h in t.key_hashes}
            for i, key_hash in enumerate(admin.key_hashes):
                if key_hash in taken:
                    raise ValueError(f"admin.keys[{i}]: the same key is tenant "
                                     f"{taken[key_hash]!r}'s; an admin key must be its own")
        return cls(tenants=tenants, models=models, queue=queue, request_timeout_s=request_timeout_s,
                   database=database, idempotency_ttl_s=idempotency_ttl_s, auth_required=True,
                   max_tokens_reservation=reservation, server=server, admin=admin,
                   response_cache=response_cache, prompt_bundles=bundles, cache_audit=audit,
                   releases=releases, per_tenant_metrics=per_tenant_metrics)

    @classmethod
    def open_default(cls, database: Optional[str] = None) -> "GatewayConfig":
        """Open mode (no config file): one tenant ``default``, no key, every model, no limits."""
        tenant = TenantConfig(name=OPEN_TENANT, priority="default", allow_fallback=True)
        return cls(tenants={OPEN_TENANT: tenant}, database=database, auth_required=False)

    def fallback_for(self, model: str) -> Optional[str]:
        """The configured fallback model for ``model``, or None."""
        route = self.models.get(model)
        return route.fallback if route else None


# --------------------------------------------------------------------------- parsing


def _parse_queue(data: Mapping) -> QueueConfig:
    section = Section(data, "queue")
    section.seen.add("kv_watermark")
    default = QueueConfig()
    queue = QueueConfig(
        max_requests=section.take("max_requests", positive_int, default.max_requests),
        max_tokens=section.take("max_tokens", positive_int, default.max_tokens),
        timeout_s=section.take("timeout_s", positive_number, default.timeout_s),
        kv_watermark=None if _explicit_null(data, "kv_watermark") else section.take(
            "kv_watermark", fraction, default.kv_watermark),
    )
    section.finish()
    return queue


def _explicit_null(data: Mapping, key: str) -> bool:
    """True when ``key`` is present with the value null (which turns a feature off)."""
    return key in data and data[key] is None


def _parse_server(data: Mapping) -> ServerLimits:
    """The ``server`` section: HTTP limits (see llmserve.contract.server_limits)."""
    section = Section(data, "server")
    default = ServerLimits()
    values = {}
    for key in ("max_body_bytes", "max_connections", "max_header_bytes", "tokenizer_threads"):
        values[key] = section.take(key, positive_int, getattr(default, key))
    for key in ("body_read_timeout_s", "header_read_timeout_s", "keep_alive_timeout_s"):
        values[key] = section.take(key, positive_number, getattr(default, key))
    section.finish()
    return ServerLimits(**values)


def _parse_models(data: Mapping) -> dict[str, ModelRoute]:
    routes: dict[str, ModelRoute] = {}
    for name, body in data.items():
        path = f"models.{name}"
        check_name(string(name, path), path)
        section = Section({} if body is None else body, path)
        fallback = section.take("fallback", string, None)
        if fallback is not None:
            check_name(fallback, f"{path}.fallback")
        section.finish()
        if fallback == name:
            raise ValueError(f"{path}.fallback: a model cannot be its own fallback")
        routes[name] = ModelRoute(name=name, fallback=fallback)
    for name, route in routes.items():  # a fallback chain must not loop back
        seen = {name}
        current = route.fallback
        while current is not None and current in routes:
            if current in seen:
                raise ValueError(f"models.{name}.fallback: fallback chain loops through {current!r}")
            seen.add(current)
            current = routes[current].fallback
    return routes


def _parse_tenants(data: Optional[Mapping]) -> dict[str, TenantConfig]:
    if data is None:
        raise ValueError("tenants: required (at least one tenant); omit --config to run open")
    if not data:
        raise ValueError("tenants: at least one tenant is required")
    tenants: dict[str, TenantConfig] = {}
    owner_of_hash: dict[str, str] = {}
    for name, body in data.items():
        path = f"tenants.{name}"
        identifier(name, path)
        tenant = _parse_tenant(name, Section(body, path))
        for i, key_hash in enumerate(tenant.key_hashes):
            if key_hash in owner_of_hash:
                raise ValueError(f"{path}.keys[{i}]: the same key is already listed for tenant "
                                 f"{owner_of_hash[key_hash]!r}")
            owner_of_hash[key_hash] = name
        tenants[name] = tenant
    for tenant in tenants.values():
        if tenant.shared_prefix and tenant.cache_namespace in tenants:
            raise ValueError(f"tenants.{tenant.name}.cache_namespace: must not be a tenant's name")
    return tenants


def _parse_tenant(name: str, section: Section) -> TenantConfig:
    path = section.path
    key_hashes = parse_key_hashes(section.data.get("keys"), f"{path}.keys")
    section.seen.add("keys")
    models = section.take("models", string_list, ["*"])
    if not models:
        raise ValueError(f"{path}.models: must list at least one model pattern (\"*\" for all)")
    priority = section.take("priority", string, "default")
    if priority not in PRIORITY_CLASSES:
        raise ValueError(f"{path}.priority: expected one of {sorted(PRIORITY_CLASSES)}, got {priority!r}")
    shared_prefix = section.take("shared_prefix", boolean, False)
    cache_namespace = section.take("cache_namespace", identifier, None)
    if cache_namespace is not None and not shared_prefix:
        raise ValueError(f"{path}.cache_namespace: only meaningful with shared_prefix: true")
    rpm = section.take("requests_per_minute", positive_int, None)
    tpm = section.take("tokens_per_minute", positive_int, None)
    request_burst = section.take("request_burst", positive_int, None)
    token_burst = section.take("token_burst", positive_int, None)
    if request_burst is not None and rpm is None:
        raise ValueError(f"{path}.request_burst: only meaningful with requests_per_minute")
    if token_burst is not None and tpm is None:
        raise ValueError(f"{path}.token_burst: only meaningful with tokens_per_minute")
    tenant = TenantConfig(
        name=name,
        key_hashes=tuple(key_hashes),
        models=tuple(models),
        priority=priority,
        requests_per_minute=rpm,
        tokens_per_minute=tpm,
        request_burst=request_burst,
        token_burst=token_burst,
        allow_fallback=section.take("allow_fallback", boolean, False),
        max_request_timeout_s=section.take("max_request_timeout_s", positive_number, None),
        max_concurrent=section.take("max_concurrent", positive_int, None),
        shared_prefix=shared_prefix,
        cache_namespace=cache_namespace,
        response_cache=section.take("response_cache", boolean, False),
        bundle_pinned_blocks=section.take("bundle_pinned_blocks", non_negative_int, None),
    )
    section.finish()
    return tenant
