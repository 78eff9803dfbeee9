"""How the gateway turns a finished request into one usage record (and a stored response).

The rules, the same whatever the client sent (streamed or not, with or without an
Idempotency-Key):

* tokens are what the engine computed (``RequestOutcome.usage``): the prompt and
  cached tokens of the prompts it scheduled -- 0 for a request that ended before it was
  ever scheduled (queue timeout, a deadline that passed in the queue, a client that
  left while it waited) -- plus the tokens generated;
* the status is the HTTP status sent, or 499 when the client went away before any
  response (even when a partial response is kept for replay);
* the finish reason is the engine's (``abort`` for a client that went away).

:func:`write_outcome` writes the record and completes (or releases) the idempotency
record. When both live in the same SQLite file (as ``build_gateway`` sets them up) the
usage row and the stored response are committed in one transaction, so a crash can
never leave a billed run without its stored response, or the reverse. No torch here.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import time
import uuid
from typing import Any, Optional

from llmserve.contract.gateway_hook import CapturedResponse, OutcomeStatus, RequestContext, RequestOutcome
from llmserve.gateway.billing.idempotency import IdempotencyStore
from llmserve.gateway.billing.ledger import BillingLedger, UsageRecord

logger = logging.getLogger(__name__)

#: Ledger / log status of a request whose client went away before any response.
CLIENT_CLOSED_STATUS = 499


def finish_reason(outcome: RequestOutcome) -> str:
    """The ledger's finish reason: the choices' common reason, or them joined by ``,``."""
    reasons = sorted({r for r in outcome.finish_reasons if r is not None})
    if len(reasons) == 1 and all(r is not None for r in outcome.finish_reasons):
        return reasons[0]
    if outcome.status == OutcomeStatus.ABORTED:
        return "abort"
    if not reasons:
        return "error"
    return ",".join(reasons)


def billing_id(ctx: RequestContext) -> str:
    """The ledger's request id: the server's id, made unique when the client chose it,
    so that a reused client X-Request-Id can never suppress a usage record."""
    if ctx.headers.get("x-request-id", "").strip() == ctx.request_id:
        return f"{ctx.request_id}.{uuid.uuid4().hex[:12]}"
    return ctx.request_id


def usage_record(ctx: RequestContext, outcome: RequestOutcome, *, tenant: str,
                 served_model: Optional[str], idempotency_key: Optional[str],
                 idempotency_run: Optional[str], release: Any = None) -> UsageRecord:
    """The usage record of an admitted request (see the module docstring); ``release``
    (a :class:`~llmserve.gateway.releases.table.Release`) fills its release columns."""
    usage = outcome.usage
    status = outcome.http_status if outcome.http_status is not None else CLIENT_CLOSED_STATUS
    return UsageRecord(
        tenant=tenant, request_id=billing_id(ctx), model=ctx.model or "",
        served_model=outcome.served_model or served_model or ctx.model or "",
        fingerprint=outcome.fingerprint or "", prompt_tokens=usage.prompt_tokens,
        cached_tokens=min(usage.cached_tokens, usage.prompt_tokens),
        completion_tokens=usage.completion_tokens, finish_reason=finish_reason(outcome),
        status=status, created_at=ctx.arrival_time,
        finished_at=max(time.time(), ctx.arrival_time),
        idempotency_key=idempotency_key, idempotency_run=idempotency_run,
        release_id=getattr(release, "id", None),
        release_fingerprint=getattr(release, "fingerprint", None))


def _same_file(ledger: BillingLedger, store: IdempotencyStore) -> bool:
    try:
        return os.path.samefile(ledger.path, store.path)
    except OSError:
        return os.path.abspath(ledger.path) == os.path.abspath(store.path)


def write_outcome(ledger: Optional[BillingLedger], store: Optional[IdempotencyStore],
                  record: UsageRecord, *, key: Optional[str], run_id: Optional[str],
                  request_id: Optional[str], response: Optional[CapturedResponse]) -> None:
    """Bill ``record`` and complete the idempotency claim with ``response`` (or release
    it when ``response`` is None). Blocking: call from a worker thread. Failures are
    logged, never raised (the response still goes out)."""
    if key is not None and store is not None and response is not None:
        also = None
        if ledger is not None and _same_file(ledger, store):
            def also(conn: sqlite3.Connection) -> None:
                BillingLedger.insert(conn, record)
        elif ledger is not None:
            _record(ledger, record)
        try:
            store.complete(record.tenant, key, response.status,
                           body=response.body if response.events is None else None,
                           events=response.events, headers=response.headers,
                           request_id=request_id, run_id=run_id, also=also)
        except Exception:  # noqa: BLE001 - log loudly; the response still goes out
            logger.exception("could not store the idempotent response of request %s",
                             record.request_id)
            if also is not None:  # the shared transaction rolled back: bill on its own
                _record(ledger, record)
        return
    if ledger is not None:
        _record(ledger, record)
    if key is not None and store is not None:
        try:
            store.abandon(record.tenant, key, request_id, run_id=run_id)
        except Exception:  # noqa: BLE001
            logger.exception("could not release idempotency key %r", key)


def _record(ledger: Optional[BillingLedger], record: UsageRecord) -> None:
    if ledger is None:
        return
    try:
        ledger.record(record)
    except Exception:  # noqa: BLE001 - log loudly; the response still goes out
        logger.exception("could not record usage of request %s", record.request_id)
