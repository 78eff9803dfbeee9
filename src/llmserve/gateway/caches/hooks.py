"""The caches in the gateway's request path: prompt bundles and the response cache.

:class:`GatewayCaches` is used by :class:`~llmserve.gateway.hook.TenantGateway`:

* ``prepare`` (the hook's ``prepare``): resolves ``prompt_bundle`` (404, or a 400 for a
  bundle with tools, which this server's chat requests do not support yet), puts its
  messages first (``ctx.prefix_messages``) and moves the request into the bundle's
  prefix-cache namespace; decides whether the response cache applies and computes
  the key;
* ``lookup``: a hit is replayed by the server as stored (``X-Cache: hit``), costs no
  engine work and is billed as a cache hit (:func:`hit_record`);
* ``complete`` (the hook's ``on_complete``): stores a cacheable answer, counts the
  bundle's use, and pins a bundle's KV after its first use where it was not pinned.

See docs/CACHING.md. No torch.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from llmserve.contract.gateway_hook import CapturedResponse, OutcomeStatus, RequestContext, RequestOutcome
from llmserve.gateway.billing.ledger import UsageRecord
from llmserve.gateway.billing.usage import billing_id
from llmserve.gateway.caches.bundle_kv import BundleKV
from llmserve.gateway.caches.prompt_bundles import SHARED, BundleRegistry, PromptBundle
from llmserve.gateway.caches.response_cache import (
    CACHE_HEADER,
    STORABLE_FINISH,
    CacheDecision,
    ResponseCache,
    cache_key,
    decide,
)
from llmserve.gateway.caches.response_store import CachedResponse
from llmserve.gateway.config.gateway_config import GatewayConfig, TenantConfig
from llmserve.gateway.routing import ModelRouter

logger = logging.getLogger(__name__)

#: Headers of a stored answer that are not replayed as stored.
_NOT_STORED = frozenset({"x-cache", "x-request-id", "content-length"})


@dataclass
class RequestCaches:
    """What the caches decided for one request."""

    bundle: Optional[PromptBundle] = None
    decision: Optional[CacheDecision] = None
    key: Optional[str] = None
    result: Optional[str] = None          # "hit" | "miss" | "bypass" (for the request log)
    target: Optional[str] = None          # the served model meant to answer (not a fallback)

    @property
    def store(self) -> bool:
        return self.key is not None and self.decision is not None and self.decision.store


def tenant_owner(tenant: str) -> str:
    return f"tenant:{tenant}"


class GatewayCaches:
    """Prompt bundles and the response cache of one gateway (module docstring)."""

    def __init__(self, config: GatewayConfig, router: ModelRouter,
                 response_cache: Optional[ResponseCache] = None,
                 bundles: Optional[BundleRegistry] = None) -> None:
        self.config = config
        self.router = router
        self.response_cache = response_cache
        self.bundles = bundles or BundleRegistry(None, config.prompt_bundles.max_versions,
                                                 config.prompt_bundles.max_bundles_per_tenant)
        self.kv = BundleKV(self._budget)
        self._tasks: set[asyncio.Task] = set()

    def _budget(self, tenant: str) -> int:
        t = self.config.tenants.get(tenant)
        return self.config.bundle_budget(t) if t is not None else 0

    @property
    def engines(self) -> dict[str, Any]:
        return {name: m.engine for name, m in self.router.models.items()}

    # ------------------------------------------------------------------ request path

    def prepare(self, ctx: RequestContext, tenant: TenantConfig, body: Any) -> RequestCaches:
        """Bundle and response-cache decisions for a parsed request (see the module
        docstring); ``body`` is the request's JSON, decoded once by the gateway."""
        rc = RequestCaches()
        ref = body.get("prompt_bundle") if ctx.endpoint == "chat.completions" else None
        if ref is not None:
            bundle = self.bundles.resolve([tenant_owner(tenant.name), SHARED], ref)
            ctx.prefix_tools = [dict(t) for t in bundle.tools] if bundle.tools else None
            ctx.prefix_messages = [dict(m) for m in bundle.messages]
            ctx.cache_salt = bundle.cache_salt(tenant.cache_salt)
            rc.bundle = bundle
        if self.response_cache is None or not tenant.response_cache:
            return rc
        rc.decision = decide(body, ctx.headers)
        rc.target = ctx.served_model or ctx.model
        served = self.router.get(rc.target)
        if not rc.decision.cacheable or served is None:
            rc.result = "bypass"
            self.response_cache.count(tenant.name, "bypass")
            return rc
        fingerprint = ctx.release_fingerprint or served.engine.fingerprint
        rc.key = cache_key(fingerprint=str(fingerprint), tenant=tenant.name,
                           endpoint=ctx.endpoint, body=body,
                           bundle=rc.bundle.bundle_id if rc.bundle else None)
        return rc

    async def lookup(self, tenant: TenantConfig, rc: RequestCaches) -> Optional[CachedResponse]:
        """The stored answer for a cacheable request, or None (a miss)."""
        if self.response_cache is None or rc.key is None or rc.decision is None:
            return None
        entry = await asyncio.to_thread(self.response_cache.get, rc.key) \
            if rc.decision.lookup else None
        rc.result = "hit" if entry is not None else "miss"
        self.response_cache.count(tenant.name, rc.result)
        return entry

    @staticmethod
    def hit_response(entry: CachedResponse) -> CapturedResponse:
        """The stored answer as the server replays it, marked ``X-Cache: hit``."""
        stored = entry.response
        headers = {k: v for k, v in stored.headers.items() if k.lower() not in _NOT_STORED}
        headers[CACHE_HEADER] = "hit"
        return CapturedResponse(stored.status, headers, body=stored.body, events=stored.events,
                                replay_kind="cache")

    @staticmethod
    def hit_record(ctx: RequestContext, tenant: str, entry: CachedResponse,
                   idempotency_key: Optional[str] = None,
                   idempotency_run: Optional[str] = None) -> UsageRecord:
        """The ledger row of a hit: the replayed answer's usage, every prompt token
        counted as cached, ``cache_hit`` set (price rule: docs/CACHING.md)."""
        return UsageRecord(
            tenant=tenant, request_id=billing_id(ctx), model=ctx.model or "",
            served_model=entry.served_model or ctx.model or "", fingerprint=entry.fingerprint,
            prompt_tokens=entry.prompt_tokens, cached_tokens=entry.prompt_tokens,
            completion_tokens=entry.completion_tokens, finish_reason=entry.finish_reason,
            status=entry.response.status, created_at=ctx.arrival_time,
            finished_at=max(time.time(), ctx.arrival_time), idempotency_key=idempotency_key,
            idempotency_run=idempotency_run, cache_hit=True,
            release_id=ctx.response_headers.get("x-llmserve-release"),
            release_fingerprint=ctx.release_fingerprint)

    async def complete(self, ctx: RequestContext, tenant: TenantConfig, rc: RequestCaches,
                       outcome: RequestOutcome, served_model: Optional[str],
                       finish_reason: str) -> None:
        """Store a cacheable answer; count a bundle's use and pin it if it is not yet."""
        served = served_model or ctx.model or ""
        if rc.bundle is not None and outcome.started:
            if not self.kv.note_use(served, tenant.name, rc.bundle.bundle_id,
                                    outcome.usage.cached_tokens) and outcome.status == OutcomeStatus.COMPLETED:
                self._warm_later(served, tenant, rc.bundle)
        response = outcome.response
        if (not rc.store or self.response_cache is None or response is None
                or response.status != 200 or outcome.status != OutcomeStatus.COMPLETED
                or served != (rc.target or ctx.model) or not outcome.finish_reasons
                or any(r not in STORABLE_FINISH for r in outcome.finish_reasons)):
            return
        stored = CapturedResponse(
            200, {k: v for k, v in response.headers.items() if k.lower() not in _NOT_STORED},
            body=response.body if response.events is None else None, events=response.events,
            replay_kind="cache")
        entry = CachedResponse(
            key=rc.key or "", tenant=tenant.name, response=stored,
            prompt_tokens=outcome.usage.prompt_tokens,
            completion_tokens=outcome.usage.completion_tokens, finish_reason=finish_reason,
            fingerprint=outcome.fingerprint or "", served_model=served, created_at=time.time())
        if await asyncio.to_thread(self.response_cache.put, entry):
            self.response_cache.count(tenant.name, "stored")

    def _warm_later(self, model: str, tenant: TenantConfig, bundle: PromptBundle) -> None:
        served = self.router.get(model)
        if served is None:
            return
        task = asyncio.get_running_loop().create_task(self.kv.warm(
            served.engine, model, tenant.name, bundle.cache_salt(tenant.cache_salt), bundle,
            prefill=False))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("pinning a prompt bundle failed: %r", task.exception())

    # ------------------------------------------------------------------ bundles API

    async def register(self, owner: str, tenant: Optional[TenantConfig], name: str,
                       messages: list[dict[str, str]], tools: Optional[list[Any]]) -> dict[str, Any]:
        """Add a bundle version; a tenant's is prefilled and pinned at once on the
        default served model. Returns its description with ``prefix_tokens``,
        ``pinned_blocks`` and ``cached_tokens`` (the pinned tokens)."""
        bundle, dropped = await asyncio.to_thread(self.bundles.create, owner, name, messages, tools)
        if dropped:
            await self.kv.release(self.engines, {b.bundle_id for b in dropped})
        out = bundle.describe()
        out.update(prefix_tokens=None, pinned_blocks=0, cached_tokens=0)
        if tenant is not None and self.router.models:
            model = next(iter(self.router.models))
            engine = self.router.models[model].engine
            pin = await self.kv.warm(engine, model, tenant.name,
                                     bundle.cache_salt(tenant.cache_salt), bundle)
            out.update(prefix_tokens=pin.prefix_tokens, pinned_blocks=pin.blocks,
                       cached_tokens=pin.blocks * pin.block_size, model=model)
        return out

    async def delete(self, owner: str, name: str, version: Optional[int]) -> list[PromptBundle]:
        """Remove bundle versions and unpin their KV everywhere."""
        removed = await asyncio.to_thread(self.bundles.delete, owner, name, version)
        if removed:
            await self.kv.release(self.engines, {b.bundle_id for b in removed})
        return removed

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self.bundles.close()
        if self.response_cache is not None:
            self.response_cache.close()
