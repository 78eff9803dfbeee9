"""The gateway in the HTTP request path: :class:`TenantGateway` and :func:`build_gateway`.

``TenantGateway`` implements the server's hook protocol
(:mod:`llmserve.server.gateway_hook`) with the gateway's building blocks:

* ``authenticate``: ``Authorization: Bearer KEY`` -> tenant (401); the tenant's
  prefix-cache salt and priority class go on the request context;
* ``prepare``: model allowed (403), ``X-Request-Timeout`` (400), ``Idempotency-Key``
  (a replay, 409, 422);
* ``admit``: context / KV checks (400), rate limits (429), the bounded queue (503) or
  the fallback model, the request deadline and the queue deadline for the engine;
* ``on_started``: the request leaves the queue;
* ``on_complete``: rate-limit settlement, one ledger record, the idempotency record
  completed (or released), one JSON log line;
* ``on_reject``: releases what an unadmitted request held and logs it.

SQLite work (idempotency, ledger) runs in worker threads (``asyncio.to_thread``) and
is awaited: a usage record is committed before a JSON response is sent, and before a
stream's ``data: [DONE]``. ``GatewayError`` is turned into the server's ``OpenAIError``
with the same status, body and headers. No torch here. See docs/GATEWAY.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

from llmserve.gateway.admission import AdmissionController, QueueTicket, parse_request_timeout
from llmserve.gateway.auth import Authenticator
from llmserve.gateway.config import GatewayConfig, TenantConfig
from llmserve.gateway.errors import GatewayError, InvalidRequest, OverloadedError
from llmserve.gateway.idempotency import (BeginOutcome, IdempotencyStore, hash_request_body,
                                          validate_idempotency_key)
from llmserve.gateway.ledger import BillingLedger, UsageRecord
from llmserve.gateway.ratelimit import Reservation, TenantRateLimiter
from llmserve.gateway.request_log import log_request_summary
from llmserve.protocol import priority_value
from llmserve.server.errors import OpenAIError
from llmserve.server.gateway_hook import CapturedResponse, RequestContext, RequestOutcome

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("llmserve.requests")

_STATE = "gateway"
#: Ledger / log status of a request whose client went away before any response.
CLIENT_CLOSED_STATUS = 499


def to_openai_error(err: GatewayError) -> OpenAIError:
    """The server's error for a gateway error: same status, body fields and headers."""
    return OpenAIError(err.status, err.message, param=err.param, code=err.code, type=err.type,
                       headers=err.headers())


@contextlib.contextmanager
def _as_openai() -> Iterator[None]:
    """Re-raise a GatewayError as the server's OpenAIError."""
    try:
        yield
    except GatewayError as err:
        raise to_openai_error(err) from None


@dataclass
class _Model:
    """One served model name: its engine and the admission controller of that engine."""

    name: str
    engine: Any
    admission: AdmissionController


@dataclass
class _RequestState:
    """What the gateway holds for one request (in ``ctx.extra["gateway"]``)."""

    tenant: TenantConfig
    timeout_s: Optional[float] = None
    idem_key: Optional[str] = None
    idem_request_id: Optional[str] = None
    reservation: Optional[Reservation] = None
    ticket: Optional[QueueTicket] = None
    queue_time_s: Optional[float] = None
    first_output_at: Optional[float] = None
    served_model: Optional[str] = None


class TenantGateway:
    """The multi-tenant gateway as a server hook (see the module docstring).

    Args:
        config: the validated gateway config.
        models: served model name -> engine (names sharing an engine share its queue).
        ledger: billing ledger, or None (no billing).
        store: idempotency store, or None (an ``Idempotency-Key`` header is then a 400).
        limiter: per-tenant rate limiter (a fresh one by default).
    """

    def __init__(self, config: GatewayConfig, models: Mapping[str, Any], *,
                 ledger: Optional[BillingLedger] = None, store: Optional[IdempotencyStore] = None,
                 limiter: Optional[TenantRateLimiter] = None) -> None:
        self.config = config
        self.auth = Authenticator(config)
        self.limiter = limiter or TenantRateLimiter()
        self.ledger = ledger
        self.store = store
        by_engine: dict[int, AdmissionController] = {}
        self.models: dict[str, _Model] = {}
        for name, engine in models.items():
            admission = by_engine.get(id(engine))
            if admission is None:
                stats = engine.get_stats()
                admission = by_engine[id(engine)] = AdmissionController.from_config(
                    config.queue, kv_pool_tokens=stats.kv_blocks_total * engine.block_size,
                    max_model_len=engine.max_model_len, block_size=engine.block_size)
            self.models[name] = _Model(name, engine, admission)

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
        ctx.extra[_STATE] = _RequestState(tenant)

    async def prepare(self, ctx: RequestContext) -> None:
        """403 for a model the tenant may not use; 400 for a bad header; idempotency."""
        st: _RequestState = ctx.extra[_STATE]
        with _as_openai():
            self.auth.check_model(st.tenant, ctx.model or "")
            st.timeout_s = parse_request_timeout(ctx.headers.get("x-request-timeout"))
            key = ctx.headers.get("idempotency-key")
            if key is None:
                return
            if self.store is None:
                raise InvalidRequest("Idempotency-Key needs a `database` in the gateway config",
                                     code="idempotency_not_enabled", param="Idempotency-Key")
            validate_idempotency_key(key)
            result = await asyncio.to_thread(self._begin, st.tenant.name, key, ctx)
        if result.outcome is BeginOutcome.REPLAY and result.response is not None:
            stored = result.response
            ctx.replay = CapturedResponse(stored.status, dict(stored.headers), body=stored.body,
                                          events=stored.events, request_id=stored.request_id)
            self._log(ctx, st, status=stored.status, idempotency_key=key, replayed=True,
                      served_model=stored.headers.get("X-Served-By"))
            return
        st.idem_key, st.idem_request_id = key, ctx.request_id
        ctx.capture_response = True

    def _begin(self, tenant: str, key: str, ctx: RequestContext) -> Any:
        try:
            body = json.loads(ctx.raw_body)
        except ValueError as e:  # the server validated it; be safe anyway
            raise InvalidRequest(f"the body is not valid JSON: {e}") from None
        if self.store is None:
            raise RuntimeError("no idempotency store")
        return self.store.begin(tenant, key, hash_request_body(body, ctx.endpoint), ctx.request_id)

    async def admit(self, ctx: RequestContext) -> None:
        """400 / 429 / 503 or admitted: picks the model, deadlines and priority."""
        st: _RequestState = ctx.extra[_STATE]
        with _as_openai():
            primary = self.models.get(ctx.model or "")
            if primary is None:  # the server passes served names only
                raise InvalidRequest(f"The model `{ctx.model}` is not served", param="model")
            tokens = ctx.prompt_tokens + ctx.max_tokens * max(1, ctx.num_choices)
            primary.admission.check_request(ctx.longest_prompt_tokens, ctx.max_tokens)
            st.reservation = self.limiter.reserve(st.tenant, tokens)
            chosen, st.ticket = self._enter_queue(st.tenant, primary, ctx, tokens)
        st.served_model = chosen.name
        if chosen.name != primary.name:
            ctx.served_model = chosen.name
            logger.info("request %s of tenant %s: %s is overloaded, served by fallback %s",
                        ctx.request_id, st.tenant.name, primary.name, chosen.name)
        timeout = st.tenant.effective_timeout(self.config.request_timeout_s, st.timeout_s)
        ctx.deadline = ctx.arrival_time + timeout
        ctx.queue_deadline = time.time() + chosen.admission.queue_timeout_s
        ctx.priority = self._priority(st.tenant, ctx.priority)

    def on_started(self, ctx: RequestContext) -> None:
        """The engine scheduled the request: it leaves the waiting queue."""
        st: Optional[_RequestState] = ctx.extra.get(_STATE)
        if st is None:
            return
        st.first_output_at = time.time()
        if st.ticket is not None and st.ticket.active:
            st.queue_time_s = st.ticket.leave()

    async def on_complete(self, ctx: RequestContext, outcome: RequestOutcome) -> None:
        """Settle, bill once, complete or release the idempotency record, log."""
        st: Optional[_RequestState] = ctx.extra.get(_STATE)
        if st is None:
            return
        reasons = [r for r in outcome.finish_reasons if r is not None]
        never_ran = not outcome.started and bool(reasons) and all(r == "queue_timeout" for r in reasons)
        if st.ticket is not None and st.ticket.active:
            waited = st.ticket.leave(timed_out=never_ran)
            st.queue_time_s = waited if st.queue_time_s is None else st.queue_time_s
        usage = outcome.usage
        prompt = 0 if never_ran else usage.prompt_tokens      # billed for what was computed
        cached = 0 if never_ran else min(usage.cached_tokens, usage.prompt_tokens)
        if st.reservation is not None:
            self.limiter.settle(st.reservation, prompt + usage.completion_tokens)
        response = outcome.response
        status = outcome.http_status if outcome.http_status is not None else CLIENT_CLOSED_STATUS
        keep = (st.idem_key is not None and response is not None and response.status == 200
                and outcome.status in ("completed", "aborted"))
        reason = _finish_reason(outcome)
        record = UsageRecord(
            tenant=st.tenant.name, request_id=self._billing_id(ctx), model=ctx.model or "",
            served_model=outcome.served_model or st.served_model or ctx.model or "",
            fingerprint=outcome.fingerprint or "", prompt_tokens=prompt, cached_tokens=cached,
            completion_tokens=usage.completion_tokens, finish_reason=reason, status=status,
            created_at=ctx.arrival_time, finished_at=time.time(),
            idempotency_key=st.idem_key if keep else None)
        await asyncio.to_thread(self._store_outcome, st, ctx, record, response if keep else None)
        self._log(ctx, st, status=status, finish_reason=reason, prompt_tokens=prompt,
                  cached_tokens=cached, completion_tokens=usage.completion_tokens,
                  fingerprint=outcome.fingerprint, served_model=record.served_model,
                  idempotency_key=st.idem_key, error=outcome.error)

    async def on_reject(self, ctx: RequestContext, error: BaseException) -> None:
        """Release the queue place, the rate-limit reservation and the idempotency claim."""
        st: Optional[_RequestState] = ctx.extra.get(_STATE)
        if st is None:
            return
        if st.ticket is not None:
            st.ticket.leave()
        if st.reservation is not None:
            self.limiter.settle(st.reservation, 0)
        if st.idem_key is not None and self.store is not None:
            await asyncio.to_thread(self.store.abandon, st.tenant.name, st.idem_key,
                                    st.idem_request_id)
        status = getattr(error, "status", None)
        if not isinstance(status, int):
            status = CLIENT_CLOSED_STATUS if isinstance(error, asyncio.CancelledError) or \
                type(error).__name__ in ("ClientDisconnect", "ClientDisconnected") else 500
        self._log(ctx, st, status=status, error_code=getattr(error, "code", None),
                  idempotency_key=st.idem_key)

    # ------------------------------------------------------------------ helpers

    def _fallback(self, tenant: TenantConfig, primary: _Model, ctx: RequestContext,
                  tokens: int) -> Optional[_Model]:
        """The fallback model to serve an overloaded request, if the tenant may use one
        and it can take the request now (its own static checks and queue)."""
        name = self.auth.may_use_fallback(tenant, primary.name)
        fallback = self.models.get(name) if name else None
        if fallback is None or fallback.admission is primary.admission:
            return None
        try:
            fallback.admission.check_request(ctx.longest_prompt_tokens, ctx.max_tokens)
        except GatewayError:
            return None  # fallback is for overload only, never to dodge a 400
        return None if fallback.admission.would_overload(tokens) else fallback

    def _enter_queue(self, tenant: TenantConfig, primary: _Model, ctx: RequestContext,
                     tokens: int) -> tuple[_Model, QueueTicket]:
        if primary.admission.would_overload(tokens):
            fallback = self._fallback(tenant, primary, ctx, tokens)
            if fallback is not None:
                try:
                    return fallback, fallback.admission.enter_queue(tokens)
                except OverloadedError:
                    pass
        try:
            return primary, primary.admission.enter_queue(tokens)
        except OverloadedError:
            fallback = self._fallback(tenant, primary, ctx, tokens)
            if fallback is None:
                raise
            return fallback, fallback.admission.enter_queue(tokens)

    @staticmethod
    def _priority(tenant: TenantConfig, requested: Any) -> Any:
        """The request's priority: what it asked for, but never above its tenant's class."""
        try:
            rank = priority_value(requested)
        except ValueError:
            return tenant.priority
        return requested if rank >= tenant.priority_rank else tenant.priority

    @staticmethod
    def _billing_id(ctx: RequestContext) -> str:
        """The ledger's request id: the server's id, made unique when the client chose it,
        so that a reused client X-Request-Id can never suppress a usage record."""
        if ctx.headers.get("x-request-id", "").strip() == ctx.request_id:
            return f"{ctx.request_id}.{uuid.uuid4().hex[:12]}"
        return ctx.request_id

    def _store_outcome(self, st: _RequestState, ctx: RequestContext, record: UsageRecord,
                       response: Optional[CapturedResponse]) -> None:
        """Ledger first, then the idempotency record (worker thread): a crash in between
        leaves a billed run whose key a retry may take over; the ledger's (tenant, key)
        uniqueness then keeps that retry from being billed again."""
        if self.ledger is not None:
            try:
                self.ledger.record(record)
            except Exception:  # noqa: BLE001 - log loudly; the response still goes out
                logger.exception("could not record usage of request %s", record.request_id)
        if st.idem_key is None or self.store is None:
            return
        try:
            if response is not None:
                self.store.complete(st.tenant.name, st.idem_key, response.status,
                                    body=response.body if response.events is None else None,
                                    events=response.events, headers=response.headers,
                                    request_id=st.idem_request_id)
            else:
                self.store.abandon(st.tenant.name, st.idem_key, st.idem_request_id)
        except Exception:  # noqa: BLE001
            logger.exception("could not store the idempotent response of request %s",
                             ctx.request_id)

    def _log(self, ctx: RequestContext, st: Optional[_RequestState], **fields: Any) -> None:
        now = time.time()
        fields = {k: v for k, v in fields.items() if v is not None}
        base: dict[str, Any] = {"request_id": ctx.request_id, "model": ctx.model,
                                "stream": ctx.stream, "duration_s": now - ctx.arrival_time}
        if st is not None:
            base["tenant"] = st.tenant.name
            base["priority"] = ctx.priority
            base["served_model"] = st.served_model
            if st.queue_time_s is not None:
                base["queue_time_s"] = st.queue_time_s
            if st.first_output_at is not None:
                base["ttft_s"] = st.first_output_at - ctx.arrival_time
        base.update(fields)
        log_request_summary(request_logger, **{k: v for k, v in base.items() if v is not None})

    def close(self) -> None:
        """Close the SQLite connections (the server calls this at shutdown)."""
        for db in (self.ledger, self.store):
            if db is not None:
                db.close()


def _finish_reason(outcome: RequestOutcome) -> str:
    reasons = sorted({r for r in outcome.finish_reasons if r is not None})
    if len(reasons) == 1 and all(r is not None for r in outcome.finish_reasons):
        return reasons[0]
    if outcome.status == "aborted":
        return "abort"
    if not reasons:
        return "error"
    return ",".join(reasons)


def build_gateway(config_path: str, engine: Any, *, fallback_engines: Optional[Mapping[str, Any]] = None,
                  served_model_names: Optional[Sequence[str]] = None) -> TenantGateway:
    """Load the gateway config and build the gateway for these engines.

    Args:
        config_path: the YAML / TOML gateway config.
        engine: the main engine (served as ``served_model_names``, default its model name).
        fallback_engines: more served models in the process, name -> engine; a
            ``models.<name>.fallback`` route may name them.
        served_model_names: the names ``engine`` is served under.

    Raises ValueError for an invalid config, or a fallback whose tokenizer differs from
    its primary's (the prompt is tokenized once, by the requested model).
    """
    config = GatewayConfig.load(config_path)
    names = list(served_model_names) if served_model_names else [engine.model_name]
    models: dict[str, Any] = {name: engine for name in names}
    for name, other in (fallback_engines or {}).items():
        if name in models:
            raise ValueError(f"fallback model name {name!r} is already served")
        models[name] = other
    for name, route in config.models.items():
        if name not in models:
            logger.warning("gateway config: models.%s names a model this server does not serve", name)
            continue
        if route.fallback is None:
            continue
        if route.fallback not in models:
            logger.warning("gateway config: models.%s.fallback %r is not served; no fallback",
                           name, route.fallback)
            continue
        mine = getattr(models[name].tokenizer, "fingerprint", None)
        theirs = getattr(models[route.fallback].tokenizer, "fingerprint", None)
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(f"models.{name}.fallback: {route.fallback!r} has a different "
                             "tokenizer; a fallback must share its primary's tokenizer")
    ledger = store = None
    if config.database is None:
        logger.warning("gateway config has no `database`: no billing ledger, no Idempotency-Key")
    else:
        ledger = BillingLedger(config.database)
        longest = max([config.request_timeout_s] + [t.max_request_timeout_s or 0.0
                                                    for t in config.tenants.values()])
        store = IdempotencyStore(config.database, ttl_s=config.idempotency_ttl_s,
                                 lease_s=max(3600.0, config.queue.timeout_s + longest + 60.0))
    return TenantGateway(config, models, ledger=ledger, store=store)
