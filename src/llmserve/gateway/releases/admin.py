"""Admin endpoints of releases (admin key only; see docs/RELEASES.md):

    GET  /admin/releases                      every public model: split, releases, health
    GET  /admin/releases/audit?model=&limit=  who changed which split when (oldest first)
    GET  /admin/releases/shadow?model=&limit= the latest shadow comparisons
    POST /admin/releases/{model}/promote      {"release"?: id (default: the canary), "reason"?}
    POST /admin/releases/{model}/rollback     {"to"?: id (a new stable), "reason"?}
    POST /admin/releases/{model}/split        {"canary"?, "canary_share"?, "shadow"?,
                                               "shadow_share"?, "reason"?}

Promote makes a release the stable one and ends the canary; rollback sets the canary's
share to 0 (and, with ``to``, makes that release the stable one). Every change is one
audit row whose actor is ``admin:<first 12 hex digits of the key's hash>``. Requests
already running keep their release (the answer lists how many are in flight on each).
No torch, no HTTP framework.
"""
from __future__ import annotations

import asyncio
from typing import Any

from llmserve.contract.gateway_hook import ExtraRoute, HTTPCall
from llmserve.gateway.admin import AdminAPI, _json_object
from llmserve.gateway.auth import parse_bearer
from llmserve.gateway.config.gateway_config import hash_api_key
from llmserve.gateway.errors import GatewayError, InvalidRequest
from llmserve.gateway.releases.config import share_value
from llmserve.gateway.releases.routing import ReleaseRouting


def _limit(call: HTTPCall) -> int:
    raw = call.query.get("limit", "100")
    if not raw.isdigit() or not 1 <= int(raw) <= 10000:
        raise InvalidRequest("limit must be an integer in [1, 10000]", param="limit")
    return int(raw)


class ReleaseAdminAPI:
    """The endpoints of the module docstring over one gateway's releases."""

    def __init__(self, releases: ReleaseRouting, admin: AdminAPI) -> None:
        self.releases = releases
        self.admin = admin

    def routes(self) -> list[ExtraRoute]:
        wrap = AdminAPI._wrap
        return [ExtraRoute("GET", "/admin/releases", wrap(self.status)),
                ExtraRoute("GET", "/admin/releases/audit", wrap(self.audit)),
                ExtraRoute("GET", "/admin/releases/shadow", wrap(self.shadow)),
                ExtraRoute("POST", "/admin/releases/{model}/promote", wrap(self.promote)),
                ExtraRoute("POST", "/admin/releases/{model}/rollback", wrap(self.rollback)),
                ExtraRoute("POST", "/admin/releases/{model}/split", wrap(self.split))]

    def _actor(self, call: HTTPCall) -> str:
        self.admin._require_admin(call)
        key = parse_bearer(call.headers.get("authorization")) or ""
        return "admin:" + hash_api_key(key).split(":", 1)[1][:12]

    def _model(self, call: HTTPCall) -> str:
        model = call.path_params.get("model", "")
        if model not in self.releases.table.models:
            raise GatewayError(404, f"no releases for model {model!r} (configured: "
                               f"{sorted(self.releases.table.models)})",
                               "invalid_request_error", "model_not_found", "model")
        return model

    def _describe(self, model: str) -> dict[str, Any]:
        out = self.releases.table.snapshot(model)
        window = self.releases.table.models[model].config.health.window_s
        for rid, info in out["releases"].items():
            info["health"] = self.releases.health.stats(rid, window)
        out["model"] = model
        return out

    async def status(self, call: HTTPCall) -> tuple[int, Any]:
        self._actor(call)
        return 200, {"object": "list",
                     "data": [self._describe(m) for m in self.releases.table.models]}

    async def audit(self, call: HTTPCall) -> tuple[int, Any]:
        self._actor(call)
        rows = await asyncio.to_thread(self.releases.store.audit_log, call.query.get("model"),
                                       _limit(call))
        return 200, {"object": "list", "data": rows}

    async def shadow(self, call: HTTPCall) -> tuple[int, Any]:
        self._actor(call)
        rows = await asyncio.to_thread(self.releases.store.shadow_log, call.query.get("model"),
                                       _limit(call))
        return 200, {"object": "list", "data": rows}

    async def _change(self, call: HTTPCall, action: str, allowed: set[str],
                      build: Any) -> tuple[int, Any]:
        actor = self._actor(call)
        model = self._model(call)
        body = _json_object(call.body)
        unknown = sorted(set(body) - allowed - {"reason"})
        if unknown:
            raise InvalidRequest(f"unknown field {unknown[0]!r}", param=unknown[0],
                                 code="unknown_parameter")
        reason = body.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise InvalidRequest("reason must be a string", param="reason")
        changes = build(model, body)
        try:
            row = await asyncio.to_thread(self.releases.change, actor, model, action, reason,
                                          **changes)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        return 200, {"object": "release.change", "event": row, "model": self._describe(model)}

    def _release_id(self, model: str, value: Any, field: str) -> str:
        versions = self.releases.table.models[model].config.versions
        if not isinstance(value, str) or value not in versions:
            raise InvalidRequest(f"{field} must be a release id of {model!r} (releases: "
                                 f"{sorted(versions)})", param=field)
        return value

    async def promote(self, call: HTTPCall) -> tuple[int, Any]:
        def build(model: str, body: dict[str, Any]) -> dict[str, Any]:
            rid = body.get("release") or self.releases.table.models[model].canary
            if rid is None:
                raise InvalidRequest("no canary is running; name the release to promote",
                                     param="release")
            return {"stable": self._release_id(model, rid, "release"), "canary": None,
                    "canary_share": 0.0}
        return await self._change(call, "promote", {"release"}, build)

    async def rollback(self, call: HTTPCall) -> tuple[int, Any]:
        def build(model: str, body: dict[str, Any]) -> dict[str, Any]:
            changes: dict[str, Any] = {"canary_share": 0.0}
            if body.get("to") is not None:
                changes["stable"] = self._release_id(model, body["to"], "to")
            return changes
        return await self._change(call, "rollback", {"to"}, build)

    async def split(self, call: HTTPCall) -> tuple[int, Any]:
        def build(model: str, body: dict[str, Any]) -> dict[str, Any]:
            changes: dict[str, Any] = {}
            for key in ("canary", "shadow"):
                if key in body:
                    changes[key] = None if body[key] is None else \
                        self._release_id(model, body[key], key)
            for key in ("canary_share", "shadow_share"):
                if key in body:
                    try:
                        changes[key] = share_value(body[key], key)
                    except ValueError as e:
                        raise InvalidRequest(str(e), param=key) from None
            if not changes:
                raise InvalidRequest("give at least one of canary, canary_share, shadow, "
                                     "shadow_share")
            return changes
        return await self._change(call, "set_share",
                                  {"canary", "canary_share", "shadow", "shadow_share"}, build)

