"""The gateway's release logic in the request path: :class:`ReleaseRouting`.

For a request whose ``model`` is a public model of the ``releases`` section,
``prepare`` picks the release (:class:`~llmserve.gateway.releases.table.ReleaseTable`),
points the request at the release's target (``ctx.served_model``), hands the server
the release's sampling defaults and adds the ``x-llmserve-release`` and
``x-llmserve-release-fingerprint`` response headers. ``admit`` counts the request as
in flight on its release; ``complete`` / ``reject`` record it in the release's health
window, start the shadow run of a mirrored request, and roll a canary that crosses a
health threshold back to share 0 (``auto_rollback`` in the audit log, counted in
``llmserve_release_rollbacks_total``). :meth:`ReleaseRouting.change` is the one way
the split changes (admin endpoints and automatic rollbacks alike): the table, the
audit log and the stored split in one step. A request keeps the release it picked
whatever changes meanwhile, so a switch never fails a request. No torch.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from llmserve.contract.gateway_hook import OutcomeStatus, RequestContext, RequestOutcome
from llmserve.gateway.config.gateway_config import GatewayConfig
from llmserve.gateway.errors import GatewayError
from llmserve.gateway.releases.health import ReleaseHealth, is_release_failure
from llmserve.gateway.releases.shadow import ShadowRunner
from llmserve.gateway.releases.store import ReleaseStore
from llmserve.gateway.releases.table import Release, ReleaseTable, ReleaseUnavailable

logger = logging.getLogger(__name__)

RELEASE_HEADER = "x-llmserve-release"
RELEASE_FINGERPRINT_HEADER = "x-llmserve-release-fingerprint"
#: Split fields an admin change may set.
SPLIT_FIELDS = ("stable", "canary", "canary_share", "shadow", "shadow_share")


@dataclass
class RequestRelease:
    """The release one request runs on (and the shadow release mirroring it)."""

    release: Release
    shadow: Optional[Release] = None
    entered: bool = False


def _config_hash(model: Any) -> str:
    blob = json.dumps(dataclasses.asdict(model), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ReleaseRouting:
    """Releases of one gateway (see the module docstring).

    Args:
        config: the gateway config (its ``releases`` section and ``database``).
        engines: served model name -> engine, or a function giving the engine of a served
            name (None if not served): targets served later (adapters) are found then.
        store: where audit rows, the split and shadow comparisons go (default: the
            config's database, else memory).
    """

    def __init__(self, config: GatewayConfig,
                 engines: "Mapping[str, Any] | Callable[[str], Any]",
                 store: Optional[ReleaseStore] = None) -> None:
        lookup = engines if callable(engines) else dict(engines).get
        self.table = ReleaseTable(config.releases, lookup)
        self.store = store or ReleaseStore(config.database if config.releases else None)
        self.health = ReleaseHealth()
        self.shadow = ShadowRunner(lookup, self.store, self.health, config.request_timeout_s)
        self.rollbacks: Counter[tuple[str, str, str]] = Counter()  # (model, release, reason)
        self._hashes = {name: _config_hash(m) for name, m in config.releases.items()}
        self._change_lock = threading.Lock()
        for name in self.table.models:
            stored = self.store.stored_state(name, self._hashes[name])
            if stored is not None:
                try:
                    self.table.update(name, **{k: stored[k] for k in SPLIT_FIELDS if k in stored})
                    logger.info("releases.%s: restored the split %s", name, stored)
                except ValueError as e:
                    logger.warning("releases.%s: stored split ignored: %s", name, e)

    def public_models(self) -> dict[str, str]:
        """Public model name -> its stable release's target."""
        return self.table.public_models()

    # ------------------------------------------------------------------ request path

    async def prepare(self, ctx: RequestContext, tenant: str) -> Optional[RequestRelease]:
        """Pick the release of a request for a public model (None for any other model);
        503 ``release_unavailable`` when the picked release's target is not served."""
        if ctx.model not in self.table.models:
            return None
        try:
            release, shadow = self.table.choose(ctx.model, tenant)
        except ReleaseUnavailable as e:
            self.health.record(e.release, True)
            await self._check(ctx.model, e.release)
            raise GatewayError(503, str(e), "overloaded_error", "release_unavailable",
                               "model") from None
        ctx.served_model = release.target
        ctx.sampling_defaults = dict(release.sampling) or None
        ctx.response_headers[RELEASE_HEADER] = release.id
        ctx.response_headers[RELEASE_FINGERPRINT_HEADER] = release.fingerprint
        ctx.release_fingerprint = release.fingerprint
        if shadow is not None:
            ctx.capture_response = True
        return RequestRelease(release, shadow)

    def admit(self, handle: Optional[RequestRelease]) -> None:
        """The request was admitted: it is in flight on its release."""
        if handle is not None and not handle.entered:
            self.table.enter(handle.release)
            handle.entered = True

    def _leave(self, handle: RequestRelease) -> None:
        if handle.entered:
            self.table.leave(handle.release)
            handle.entered = False

    async def complete(self, ctx: RequestContext, tenant: str, handle: Optional[RequestRelease],
                       outcome: RequestOutcome, first_output_at: Optional[float]) -> None:
        """Record a finished request, mirror it to the shadow, check the canary."""
        if handle is None:
            return
        self._leave(handle)
        if outcome.status == OutcomeStatus.ABORTED:
            return
        ttft = tpot = None
        if first_output_at is not None:
            ttft = max(0.0, first_output_at - ctx.arrival_time)
            tokens = outcome.usage.completion_tokens
            if tokens > 1:
                tpot = max(0.0, time.time() - first_output_at) / (tokens - 1)
        failed = outcome.status == OutcomeStatus.ERROR and (outcome.http_status is None
                                                or outcome.http_status >= 500)
        self.health.record(handle.release.id, failed, ttft, tpot)
        if handle.shadow is not None and outcome.status == OutcomeStatus.COMPLETED:
            self.shadow.start(ctx, tenant, handle.release, handle.shadow, outcome.response)
        await self._check(handle.release.model, handle.release.id)

    async def reject(self, handle: Optional[RequestRelease], error: BaseException) -> None:
        """Record a request that ended before admission, when it was the release's fault."""
        if handle is None:
            return
        self._leave(handle)
        if is_release_failure(getattr(error, "status", None), getattr(error, "code", None)):
            self.health.record(handle.release.id, True)
            await self._check(handle.release.model, handle.release.id)

    async def _check(self, model: str, rid: str) -> None:
        """Roll the canary ``rid`` of ``model`` back when it crossed a health threshold."""
        state = self.table.models[model]
        if state.canary != rid or state.canary_share <= 0:
            return
        reason = self.health.verdict(rid, state.config.health)
        if reason is None:
            return
        logger.warning("release %s of %s crossed its %s threshold (%s): rolling the canary "
                       "back to share 0", rid, model, reason,
                       self.health.stats(rid, state.config.health.window_s))
        await asyncio.to_thread(self.change, "auto", model, "auto_rollback", reason,
                                expect_canary=rid, canary_share=0.0)

    # ------------------------------------------------------------------ split changes

    def change(self, actor: str, model: str, action: str, reason: Optional[str],
               expect_canary: Optional[str] = None, **changes: Any) -> Optional[dict[str, Any]]:
        """Change ``model``'s split, audit it and store it; returns the audit row (None
        when ``expect_canary`` is no longer the running canary: an automatic rollback
        that another one already did). Raises KeyError / ValueError as
        :meth:`ReleaseTable.update`."""
        unknown = set(changes) - set(SPLIT_FIELDS)
        if unknown:
            raise ValueError(f"unknown split field {sorted(unknown)[0]!r}")
        with self._change_lock:
            state = self.table.models[model]
            if expect_canary is not None and (state.canary != expect_canary
                                              or state.canary_share <= 0):
                return None
            before, after = self.table.update(model, **changes)
            row = self.store.audit(actor, model, action, reason, before, after,
                                   self._hashes[model])
        if action == "auto_rollback" and expect_canary is not None:
            self.rollbacks[(model, expect_canary, reason or "")] += 1
        elif action == "rollback" and before.get("canary") and before.get("canary_share"):
            self.rollbacks[(model, before["canary"], "manual")] += 1
        for rid in {before.get("canary"), after.get("canary")}:
            if isinstance(rid, str):
                self.health.reset(rid)
        logger.warning("releases.%s: %s by %s (%s): %s -> %s", model, action, actor, reason,
                       before, after)
        return row

    def close(self) -> None:
        self.store.close()
