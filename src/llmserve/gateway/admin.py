"""The gateway's extra endpoints: prompt bundles (tenant key or admin key) and cache
operations (admin key only). Served by the HTTP app through ``http_routes()``
(:class:`~llmserve.contract.gateway_hook.ExtraRoute`); no HTTP framework here.

    POST   /v1/prompt_bundles                 {"name", "messages", "tools"?} -> a new version
    GET    /v1/prompt_bundles                 the caller's bundles and the shared ones
    GET    /v1/prompt_bundles/{name}          every version of one name
    DELETE /v1/prompt_bundles/{name}[@v]      delete a version or the name (unpins the KV)
    POST   /admin/prefix_cache/flush          {"tenant"} | {"namespace"} | {"all": true}
    GET    /admin/cache/stats                 blocks used / pinned, hit rates by tenant and bundle

A tenant key manages the tenant's own bundles; the admin key (``admin.keys`` in the
config) manages the shared ones and is the only key the ``/admin`` endpoints accept.
See docs/CACHING.md. No torch.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

from llmserve.contract.engine_client import PrefixCacheAdmin
from llmserve.contract.gateway_hook import ExtraRoute, HTTPCall
from llmserve.gateway.auth import Authenticator, match_key_hash, parse_bearer
from llmserve.gateway.caches.bundle_kv import bundle_prefix_tokens
from llmserve.gateway.caches.hooks import GatewayCaches, tenant_owner
from llmserve.gateway.caches.prompt_bundles import SHARED, BundleNotFound, parse_bundle_body, parse_ref
from llmserve.gateway.config.gateway_config import GatewayConfig, TenantConfig
from llmserve.gateway.errors import (
    AuthenticationError,
    GatewayError,
    InvalidRequest,
    PermissionDeniedError,
    to_openai_error,
)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        raise InvalidRequest(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("expected a JSON object")
    return body


class AdminAPI:
    """The endpoints of the module docstring, over one gateway's caches."""

    def __init__(self, config: GatewayConfig, auth: Authenticator, caches: GatewayCaches) -> None:
        self.config = config
        self.auth = auth
        self.caches = caches
        hashes = config.admin.key_hashes if config.admin is not None else ()
        self._admin_hashes = [(h.encode("ascii"), True) for h in hashes]

    def routes(self) -> list[ExtraRoute]:
        return [ExtraRoute("POST", "/v1/prompt_bundles", self._wrap(self.create_bundle)),
                ExtraRoute("GET", "/v1/prompt_bundles", self._wrap(self.list_bundles)),
                ExtraRoute("GET", "/v1/prompt_bundles/{name}", self._wrap(self.get_bundle)),
                ExtraRoute("DELETE", "/v1/prompt_bundles/{name}", self._wrap(self.delete_bundle)),
                ExtraRoute("POST", "/admin/prefix_cache/flush", self._wrap(self.flush)),
                ExtraRoute("GET", "/admin/cache/stats", self._wrap(self.stats))]

    @staticmethod
    def _wrap(handler: Any) -> Any:
        async def run(call: HTTPCall) -> tuple[int, Any]:
            try:
                return await handler(call)
            except GatewayError as err:
                raise to_openai_error(err) from None
        return run

    # ------------------------------------------------------------------ who calls

    def is_admin(self, call: HTTPCall) -> bool:
        """True when the Bearer key is an admin key (constant-time over the key list)."""
        key = parse_bearer(call.headers.get("authorization"))
        if key is None or not self._admin_hashes:
            return False
        return bool(match_key_hash(key, self._admin_hashes))

    def _caller(self, call: HTTPCall) -> tuple[str, Optional[TenantConfig]]:
        """(bundle owner, tenant): the shared owner for the admin key, else the tenant's."""
        if self.is_admin(call):
            return SHARED, None
        tenant = self.auth.authenticate(call.headers.get("authorization"))
        return tenant_owner(tenant.name), tenant

    def _require_admin(self, call: HTTPCall) -> None:
        if self.is_admin(call):
            return
        if parse_bearer(call.headers.get("authorization")) is None:
            raise AuthenticationError("Missing API key; send 'Authorization: Bearer <admin key>'",
                                      code="missing_api_key")
        raise PermissionDeniedError("this endpoint needs an admin key (`admin.keys` in the "
                                    "gateway config)", code="admin_key_required", param=None)

    # ------------------------------------------------------------------ bundles

    async def create_bundle(self, call: HTTPCall) -> tuple[int, Any]:
        owner, tenant = self._caller(call)
        name, messages, tools = parse_bundle_body(call.body)
        await self._check_bundle_fits(name, messages, tools)
        return 200, await self.caches.register(owner, tenant, name, messages, tools)

    async def _check_bundle_fits(self, name: str, messages: list[dict[str, Any]],
                                 tools: Optional[list[Any]]) -> None:
        """400 ``bundle_too_long`` when the bundle's prompt leaves no room for a request in
        any served model's context: such a bundle could never be used."""
        engines = self._engines()
        sizes = []
        for served, engine in engines.items():
            tokens = await asyncio.to_thread(bundle_prefix_tokens, engine.tokenizer,
                                             list(messages), list(tools or []))
            if len(tokens) + 2 <= engine.max_model_len:   # room for a user token and an answer
                return
            sizes.append(f"{len(tokens)} tokens for {served!r} (context {engine.max_model_len})")
        if sizes:
            raise InvalidRequest(f"prompt bundle {name!r} cannot fit any served model's "
                                 f"context: {'; '.join(sizes)}", param="messages",
                                 code="bundle_too_long")

    async def list_bundles(self, call: HTTPCall) -> tuple[int, Any]:
        owner, _tenant = self._caller(call)
        owners = [owner] if owner == SHARED else [owner, SHARED]
        data = [b.describe() for b in self.caches.bundles.listing(owners)]
        return 200, {"object": "list", "data": data}

    async def get_bundle(self, call: HTTPCall) -> tuple[int, Any]:
        owner, _tenant = self._caller(call)
        name, version = parse_ref(call.path_params.get("name", ""))
        for who in ([owner] if owner == SHARED else [owner, SHARED]):
            found = [b for b in self.caches.bundles.versions(who, name)
                     if version is None or b.version == version]
            if found:
                return 200, {"object": "list", "data": [b.describe() for b in found]}
        raise BundleNotFound(f"prompt bundle {call.path_params.get('name')!r} does not exist",
                             param="name")

    async def delete_bundle(self, call: HTTPCall) -> tuple[int, Any]:
        owner, _tenant = self._caller(call)
        name, version = parse_ref(call.path_params.get("name", ""))
        if version is None and call.query.get("version"):
            _n, version = parse_ref(f"{name}@{call.query['version']}")
        removed = await self.caches.delete(owner, name, version)
        if not removed:
            raise BundleNotFound(f"prompt bundle {call.path_params.get('name')!r} does not "
                                 "exist", param="name")
        return 200, {"object": "prompt_bundle.deleted", "name": name,
                     "versions": [b.version for b in removed], "deleted": True}

    # ------------------------------------------------------------------ cache operations

    def _engines(self) -> dict[str, Any]:
        """One served name per distinct engine."""
        out: dict[str, Any] = {}
        seen: set[int] = set()
        for name, model in self.caches.router.models.items():
            engine = getattr(model.engine, "base_engine", model.engine)   # LoRA view -> base
            if id(engine) not in seen:
                seen.add(id(engine))
                out[name] = engine
        return out

    async def flush(self, call: HTTPCall) -> tuple[int, Any]:
        """Drop cached prefixes: a tenant's (its namespace and its bundles' namespaces),
        one namespace, or all; pinned bundle blocks stay. ``"response_cache": true``
        also drops that tenant's (or every) stored answer."""
        self._require_admin(call)
        body = _json_object(call.body)
        unknown = sorted(set(body) - {"tenant", "namespace", "all", "response_cache"})
        if unknown:
            raise InvalidRequest(f"unknown field {unknown[0]!r}", param=unknown[0],
                                 code="unknown_parameter")
        chosen = [k for k in ("tenant", "namespace", "all") if body.get(k) not in (None, False)]
        if len(chosen) != 1:
            raise InvalidRequest("give exactly one of \"tenant\", \"namespace\" or \"all\": true")
        tenant_name = body.get("tenant")
        namespace, children = None, False
        if tenant_name is not None:
            tenant = self.config.tenants.get(tenant_name) if isinstance(tenant_name, str) else None
            if tenant is None:
                raise InvalidRequest(f"unknown tenant {tenant_name!r}", param="tenant")
            namespace, children = tenant.cache_salt, True
        elif body.get("namespace") is not None:
            if not isinstance(body["namespace"], str) or not body["namespace"]:
                raise InvalidRequest("namespace must be a non-empty string", param="namespace")
            namespace = body["namespace"]
        dropped: dict[str, int] = {}
        for name, engine in self._engines().items():
            if isinstance(engine, PrefixCacheAdmin):
                dropped[name] = await engine.flush_prefix_cache(namespace, with_children=children)
        responses = 0
        cache = self.caches.response_cache
        if body.get("response_cache") and cache is not None:
            responses = await asyncio.to_thread(cache.store.flush, tenant_name)
        return 200, {"namespace": namespace, "with_sub_namespaces": children,
                     "blocks_dropped": dropped, "responses_dropped": responses}

    async def stats(self, call: HTTPCall) -> tuple[int, Any]:
        """Per engine: blocks used / cached / pinned; per tenant: prefix hit rate (its
        namespace and its bundles'), pinned blocks and budget; per bundle: hit rate."""
        self._require_admin(call)
        engines: dict[str, dict[str, Any]] = {}
        for name, engine in self._engines().items():
            if isinstance(engine, PrefixCacheAdmin):
                engines[name] = await engine.cache_stats()
        tenants = {}
        for tenant in self.config.tenants.values():
            salt, queried, hit = tenant.cache_salt, 0, 0
            for stats in engines.values():
                for ns, counts in stats.get("prefix_tokens_by_namespace", {}).items():
                    if ns == salt or ns.startswith(salt + "|"):
                        queried += counts["queried"]
                        hit += counts["hit"]
            tenants[tenant.name] = {
                "namespace": salt, "prefix_queried_tokens": queried, "prefix_hit_tokens": hit,
                "prefix_hit_rate": hit / queried if queried else None,
                "pinned_blocks": self.caches.kv.pinned_blocks(tenant.name),
                "pin_budget_blocks": self.config.bundle_budget(tenant)}
        cache = self.caches.response_cache
        response_cache = await asyncio.to_thread(cache.snapshot) if cache is not None else None
        return 200, {"engines": engines, "tenants": tenants,
                     "bundles": self.caches.kv.snapshot(), "response_cache": response_cache}
