"""The gateway in the HTTP request path: :class:`TenantGateway`.

``TenantGateway`` implements the server's hook protocol
(:mod:`llmserve.contract.gateway_hook`) with the gateway's building blocks:

* ``authenticate``: ``Authorization: Bearer KEY`` -> tenant (401); the tenant's
  prefix-cache salt and priority class go on the request context;
* ``preadmit``: before the body is parsed, from its size alone: the tenant's
  concurrency cap, one request and a low estimate of the prompt's tokens from its
  rate-limit buckets (429 / 400);
* ``prepare``: model allowed (403), ``X-Request-Timeout`` (400), ``Idempotency-Key``
  (a replay, 409 with ``Retry-After``, 422);
* ``admit``: context / KV checks (400), the rate-limit reservation grown to the real
  amount (429), live-KV admission (503 ``kv_cache_pressure``), the bounded queue (503)
  or the fallback model, the request deadline and the queue deadline for the engine;
* ``on_started``: the request leaves the queue;
* ``on_complete``: rate-limit settlement, one ledger record and the idempotency record
  completed (or released) -- in one SQLite transaction --, one JSON log line;
* ``on_reject``: releases what an unadmitted request held (charging the prompt tokens
  it made the server tokenize) and logs it.

SQLite work (idempotency, ledger) runs in worker threads (``asyncio.to_thread``) and
is awaited: a usage record is committed before a JSON response is sent, and before a
stream's ``data: [DONE]``. Expired idempotency records are purged every
``purge_interval_s`` on a daemon thread. ``GatewayError`` is turned into the server's
``OpenAIError`` with the same status, body and headers. The served models, their queues
and KV gates, and the fallback choice are in :mod:`llmserve.gateway.routing`. No torch
here. See docs/GATEWAY.md; :func:`build_gateway` builds one from a config file.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

from llmserve.contract.engine_client import EngineClient
from llmserve.contract.gateway_hook import (
    ExtraRoute,
    Gateway,
    OutcomeStatus,
    RequestContext,
    RequestOutcome,
)
from llmserve.contract.server_limits import PARSE_INLINE_BYTES
from llmserve.gateway.admin import AdminAPI
from llmserve.gateway.admission.controller import QueueTicket, parse_request_timeout
from llmserve.gateway.admission.kv import KVCommitment
from llmserve.gateway.admission.ratelimit import Reservation, TenantRateLimiter, estimate_tokens_from_bytes
from llmserve.gateway.auth import Authenticator
from llmserve.gateway.billing.idempotency import (
    BeginOutcome,
    IdempotencyStore,
    PeriodicTask,
    hash_request_body,
    validate_idempotency_key,
)
from llmserve.gateway.billing.ledger import BillingLedger
from llmserve.gateway.billing.request_log import log_request_summary
from llmserve.gateway.billing.usage import CLIENT_CLOSED_STATUS, usage_record, write_outcome
from llmserve.gateway.caches.hooks import GatewayCaches, RequestCaches
from llmserve.gateway.caches.metrics import CacheMetricsCollector
from llmserve.gateway.caches.prompt_bundles import BundleRegistry
from llmserve.gateway.caches.response_cache import CACHE_HEADER, ResponseCache
from llmserve.gateway.caches.response_store import CachedResponse
from llmserve.gateway.config.gateway_config import GatewayConfig, TenantConfig
from llmserve.gateway.errors import GatewayError, InvalidRequest, to_openai_error
from llmserve.gateway.releases.admin import ReleaseAdminAPI
from llmserve.gateway.releases.metrics import ReleaseMetricsCollector
from llmserve.gateway.releases.routing import ReleaseRouting, RequestRelease
from llmserve.gateway.routing import ModelRouter
from llmserve.protocol import priority_value

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("llmserve.requests")

#: How often expired idempotency records are purged (seconds).
PURGE_INTERVAL_S = 60.0


async def _parsed_body(ctx: RequestContext) -> Any:
    """The request body as JSON, decoded once for the bundle, response-cache and
    idempotency decisions (the server validated it already; 400 if it is not JSON)."""
    raw = ctx.raw_body or b""
    try:
        if len(raw) > PARSE_INLINE_BYTES:
            return await asyncio.to_thread(json.loads, raw)
        return json.loads(raw)
    except ValueError as e:
        raise InvalidRequest(f"the body is not valid JSON: {e}") from None


@contextlib.contextmanager
def _as_openai() -> Iterator[None]:
    """Re-raise a GatewayError as the server's OpenAIError."""
    try:
        yield
    except GatewayError as err:
        raise to_openai_error(err) from None


@dataclass
class _RequestState:
    """What the gateway holds for one request (``ctx.gateway_state``)."""

    tenant: TenantConfig
    timeout_s: Optional[float] = None
    idem_key: Optional[str] = None
    idem_request_id: Optional[str] = None
    idem_run_id: Optional[str] = None
    reservation: Optional[Reservation] = None
    ticket: Optional[QueueTicket] = None
    kv: Optional[KVCommitment] = None
    queue_time_s: Optional[float] = None
    first_output_at: Optional[float] = None
    served_model: Optional[str] = None
    caches: Optional[RequestCaches] = None
    rel: Optional[RequestRelease] = None   # the release it runs on (docs/RELEASES.md)

    def release(self) -> None:
        """Leave the queue and give back the committed KV blocks (idempotent)."""
        if self.ticket is not None and self.ticket.active:
            self.ticket.leave()
        if self.kv is not None:
            self.kv.release()



def _state_or_none(ctx: RequestContext) -> Optional[_RequestState]:
    """This gateway's state of ``ctx`` (None before ``authenticate`` set it)."""
    st = ctx.gateway_state
    return st if isinstance(st, _RequestState) else None


def _state_of(ctx: RequestContext) -> _RequestState:
    """This gateway's state of an authenticated ``ctx``."""
    st = _state_or_none(ctx)
    if st is None:
        raise RuntimeError(f"request {ctx.request_id}: no gateway state (authenticate did not run)")
    return st

class TenantGateway(Gateway):
    """The multi-tenant gateway as a server hook (see the module docstring).

    Args:
        config: the validated gateway config.
        models: served model name -> engine (names sharing an engine share its queue).
        ledger: billing ledger, or None (no billing).
        store: idempotency store, or None (an ``Idempotency-Key`` header is then a 400).
        limiter: per-tenant rate limiter (a fresh one by default).
        purge_interval_s: how often expired idempotency records are deleted.
        response_cache: the response cache, or None (``build_gateway`` builds it from the
            config when a tenant opts in).
        bundles: the prompt-bundle registry (default: in memory).
    """

    resolves_prompt_bundles = True   # caches/hooks.py resolves them in prepare

    def __init__(self, config: GatewayConfig, models: Mapping[str, Any], *,
                 ledger: Optional[BillingLedger] = None, store: Optional[IdempotencyStore] = None,
                 limiter: Optional[TenantRateLimiter] = None,
                 purge_interval_s: float = PURGE_INTERVAL_S,
                 response_cache: Optional[ResponseCache] = None,
                 bundles: Optional[BundleRegistry] = None) -> None:
        self.config = config
        self.per_tenant_metrics = config.per_tenant_metrics
        self.auth = Authenticator(config)
        self.limiter = limiter or TenantRateLimiter()
        self.ledger = ledger
        self.store = store
        self.router = ModelRouter(config, models, self.auth)
        self.caches = GatewayCaches(config, self.router, response_cache, bundles)
        self.admin = AdminAPI(config, self.auth, self.caches)
        self.releases = ReleaseRouting(config, self._engine_of)
        self.release_admin = ReleaseAdminAPI(self.releases, self.admin)
        self._purger = None
        if store is not None:
            self._purger = PeriodicTask(store.purge_expired, purge_interval_s,
                                        "llmserve-idempotency-purge").start()

    def _engine_of(self, name: str) -> Any:
        """The engine of a served model name now (None if not served)."""
        served = self.router.get(name)
        return served.engine if served is not None else None

    def public_models(self) -> dict[str, str]:
        """Model names served through releases (public name -> stable target)."""
        return self.releases.public_models()

    # ------------------------------------------------------------------ hooks

    async def authenticate(self, ctx: RequestContext) -> None:
        """401 unless the Bearer key belongs to a tenant; sets tenant, cache salt, priority."""
        try:
            tenant = self.auth.authenticate(ctx.headers.get("authorization"))
        except GatewayError as err:
            if ctx.endpoint != "models":
                self._log(ctx, None, status=err.status, error_code=err.code)
            raise to_openai_error(err) from None
        ctx.tenant = tenant.name
        ctx.cache_salt = tenant.cache_salt
        ctx.priority = tenant.priority
        ctx.gateway_state = _RequestState(tenant)

    async def preadmit(self, ctx: RequestContext) -> None:
        """Before parsing: concurrency cap, one request and the size's token estimate (429)."""
        st = _state_of(ctx)
        with _as_openai():
            st.reservation = self.limiter.reserve(st.tenant,
                                                  estimate_tokens_from_bytes(ctx.body_bytes))

    async def prepare(self, ctx: RequestContext) -> None:
        """403 for a model the tenant may not use; 400 for a bad header; prompt bundle;
        idempotency (a replay wins), then the response cache (a hit is replayed)."""
        st = _state_of(ctx)
        with _as_openai():
            self.auth.check_model(st.tenant, ctx.model or "")
            st.rel = await self.releases.prepare(ctx, st.tenant.name)
            st.timeout_s = parse_request_timeout(ctx.headers.get("x-request-timeout"))
            body = await _parsed_body(ctx)
            st.caches = self.caches.prepare(ctx, st.tenant, body)
            key = ctx.headers.get("idempotency-key")
            result = None
            if key is not None:
                if self.store is None:
                    raise InvalidRequest("Idempotency-Key needs a `database` in the gateway config",
                                         code="idempotency_not_enabled", param="Idempotency-Key")
                validate_idempotency_key(key)
                result = await asyncio.to_thread(self._begin, st.tenant.name, key, ctx, body)
        if result is not None and result.outcome is BeginOutcome.REPLAY and result.response is not None:
            stored = result.response
            ctx.replay = stored   # replay_kind "idempotency": sent with Idempotent-Replayed
            if st.reservation is not None:  # a replay costs a request, no tokens
                self.limiter.settle(st.reservation, 0)
            self._log(ctx, st, status=stored.status, idempotency_key=key, replayed=True,
                      served_model=stored.headers.get("X-Served-By"))
            return
        if result is not None:
            st.idem_key, st.idem_request_id, st.idem_run_id = key, ctx.request_id, result.run_id
            ctx.capture_response = True
        hit = await self.caches.lookup(st.tenant, st.caches)
        if hit is not None:
            await self._replay_cache_hit(ctx, st, hit)
        elif st.caches.store:
            ctx.capture_response = True
            ctx.response_headers[CACHE_HEADER] = "miss"

    async def _replay_cache_hit(self, ctx: RequestContext, st: _RequestState,
                                hit: CachedResponse) -> None:
        """Answer from the response cache: billed as a hit (one request, no engine
        tokens for the rate limiter); completes the request's idempotency claim too."""
        response = self.caches.hit_response(hit)
        ctx.replay = response
        if st.reservation is not None:
            self.limiter.settle(st.reservation, 0)
        record = self.caches.hit_record(ctx, st.tenant.name, hit, st.idem_key, st.idem_run_id)
        await asyncio.to_thread(write_outcome, self.ledger, self.store, record,
                                key=st.idem_key, run_id=st.idem_run_id,
                                request_id=st.idem_request_id,
                                response=response if st.idem_key is not None else None)
        self._log(ctx, st, status=hit.response.status, cache="hit", idempotency_key=st.idem_key,
                  served_model=hit.served_model, prompt_tokens=hit.prompt_tokens,
                  completion_tokens=hit.completion_tokens)

    def _begin(self, tenant: str, key: str, ctx: RequestContext, body: Any) -> Any:
        if self.store is None:
            raise RuntimeError("no idempotency store")
        return self.store.begin(tenant, key, hash_request_body(body, ctx.endpoint), ctx.request_id)

    async def admit(self, ctx: RequestContext) -> None:
        """400 / 429 / 503 or admitted: picks the model, deadlines and priority."""
        st = _state_of(ctx)
        with _as_openai():
            primary = self.router.get(ctx.served_model or ctx.model)
            if primary is None:  # the server passes served names only
                raise InvalidRequest(f"The model `{ctx.model}` is not served", param="model")
            primary.admission.check_request(ctx.longest_prompt_tokens, ctx.max_tokens)
            reserve = self.router.completion_reservation(st.tenant, ctx)
            tokens = ctx.prompt_tokens + reserve * max(1, ctx.num_choices)
            if st.reservation is None:  # a server that does not call preadmit
                st.reservation = self.limiter.reserve(st.tenant, tokens)
            else:
                self.limiter.resize(st.reservation, tokens)
            placement = self.router.enter(st.tenant, primary, ctx, tokens, reserve)
        chosen, st.ticket, st.kv = placement.model, placement.ticket, placement.kv
        self.releases.admit(st.rel)
        st.served_model = chosen.name
        if chosen.name != primary.name:
            ctx.served_model = chosen.name
            logger.info("request %s of tenant %s: %s is overloaded, served by fallback %s",
                        ctx.request_id, st.tenant.name, primary.name, chosen.name)
        timeout = st.tenant.effective_timeout(self.config.request_timeout_s, st.timeout_s)
        ctx.deadline = ctx.arrival_time + timeout
        # the queue timeout counts from arrival: reading, parsing and tokenizing a request
        # under load is time the client already waited
        ctx.queue_deadline = ctx.arrival_time + chosen.admission.queue_timeout_s
        ctx.priority = self._priority(st.tenant, ctx.priority)

    def on_started(self, ctx: RequestContext) -> None:
        """The engine scheduled the request: it leaves the waiting queue."""
        st = _state_or_none(ctx)
        if st is None:
            return
        st.first_output_at = time.time()
        if st.ticket is not None and st.ticket.active:
            st.queue_time_s = st.ticket.leave()

    async def on_complete(self, ctx: RequestContext, outcome: RequestOutcome) -> None:
        """Settle, bill once, complete or release the idempotency record, log."""
        st = _state_or_none(ctx)
        if st is None:
            return
        reasons = [r for r in outcome.finish_reasons if r is not None]
        never_ran = not outcome.started and bool(reasons) and all(r == "queue_timeout" for r in reasons)
        if st.ticket is not None and st.ticket.active:
            waited = st.ticket.leave(timed_out=never_ran)
            st.queue_time_s = waited if st.queue_time_s is None else st.queue_time_s
        st.release()
        usage = outcome.usage
        if st.reservation is not None:  # every prompt token tokenized, every token generated
            self.limiter.settle(st.reservation, max(ctx.prompt_tokens, usage.prompt_tokens)
                                + usage.completion_tokens)
        response = outcome.response
        keep = (st.idem_key is not None and response is not None and response.status == 200
                and outcome.status in (OutcomeStatus.COMPLETED, OutcomeStatus.ABORTED))
        record = usage_record(ctx, outcome, tenant=st.tenant.name, served_model=st.served_model,
                              idempotency_key=st.idem_key if keep else None,
                              idempotency_run=st.idem_run_id if keep else None,
                              release=st.rel.release if st.rel else None)
        await asyncio.to_thread(write_outcome, self.ledger, self.store, record,
                                key=st.idem_key, run_id=st.idem_run_id,
                                request_id=st.idem_request_id, response=response if keep else None)
        if st.caches is not None:
            try:
                await self.caches.complete(ctx, st.tenant, st.caches, outcome, st.served_model,
                                           record.finish_reason)
            except Exception:  # noqa: BLE001 - caching must never fail a response
                logger.exception("response cache / prompt bundle upkeep failed for %s",
                                 ctx.request_id)
        self._log(ctx, st, status=record.status, finish_reason=record.finish_reason,
                  cache=st.caches.result if st.caches else None,
                  prompt_bundle=st.caches.bundle.ref if st.caches and st.caches.bundle else None,
                  prompt_tokens=record.prompt_tokens, cached_tokens=record.cached_tokens,
                  completion_tokens=usage.completion_tokens, fingerprint=outcome.fingerprint,
                  served_model=record.served_model, idempotency_key=st.idem_key,
                  error=outcome.error)
        await self.releases.complete(ctx, st.tenant.name, st.rel, outcome, st.first_output_at)

    async def on_reject(self, ctx: RequestContext, error: BaseException) -> None:
        """Release the queue place, the KV commitment, the rate-limit reservation (charging
        the prompt tokens already tokenized) and the idempotency claim."""
        st = _state_or_none(ctx)
        if st is None:
            return
        st.release()
        if st.reservation is not None:
            self.limiter.settle(st.reservation, ctx.prompt_tokens)
        if st.idem_key is not None and self.store is not None:
            await asyncio.to_thread(self.store.abandon, st.tenant.name, st.idem_key,
                                    st.idem_request_id, st.idem_run_id)
        status = getattr(error, "status", None)
        if not isinstance(status, int):
            status = CLIENT_CLOSED_STATUS if isinstance(error, asyncio.CancelledError) or \
                type(error).__name__ in ("ClientDisconnect", "ClientDisconnected") else 500
        self._log(ctx, st, status=status, error_code=getattr(error, "code", None),
                  idempotency_key=st.idem_key)
        await self.releases.reject(st.rel, error)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _priority(tenant: TenantConfig, requested: Any) -> Any:
        """The request's priority: what it asked for, but never above its tenant's class."""
        try:
            rank = priority_value(requested)
        except ValueError:
            return tenant.priority
        return requested if rank >= tenant.priority_rank else tenant.priority

    def _log(self, ctx: RequestContext, st: Optional[_RequestState], **fields: Any) -> None:
        now = time.time()
        fields = {k: v for k, v in fields.items() if v is not None}
        base: dict[str, Any] = {"request_id": ctx.request_id, "model": ctx.model,
                                "stream": ctx.stream, "duration_s": now - ctx.arrival_time}
        if st is not None:
            base["tenant"] = st.tenant.name
            base["priority"] = ctx.priority
            base["served_model"] = st.served_model
            if st.rel is not None:
                base["release"] = st.rel.release.id
                base["release_fingerprint"] = st.rel.release.fingerprint
            if st.queue_time_s is not None:
                base["queue_time_s"] = st.queue_time_s
            if st.first_output_at is not None:
                base["ttft_s"] = st.first_output_at - ctx.arrival_time
        base.update(fields)
        log_request_summary(request_logger, **{k: v for k, v in base.items() if v is not None})

    def http_routes(self) -> list[ExtraRoute]:
        """The prompt-bundle and admin endpoints (:mod:`llmserve.gateway.admin`)."""
        return self.admin.routes() + self.release_admin.routes()

    def register_metrics(self, registry: Any) -> None:
        """Response-cache and prompt-bundle metrics in the app's registry."""
        registry.register(CacheMetricsCollector(self.caches, self.config,
                                                per_tenant=self.per_tenant_metrics))
        registry.register(ReleaseMetricsCollector(self.releases))

    def close(self) -> None:
        """Stop the purge thread and close the SQLite connections (at server shutdown)."""
        if self._purger is not None:
            self._purger.stop()
        self.caches.close()
        self.releases.close()
        for db in (self.ledger, self.store):
            if db is not None:
                db.close()


def build_gateway(config_path: str, engine: EngineClient, **kwargs: Any) -> TenantGateway:
    """Load the gateway config and build the gateway (:func:`llmserve.gateway.build.build_gateway`)."""
    from llmserve.gateway.build import build_gateway as build

    return build(config_path, engine, **kwargs)
