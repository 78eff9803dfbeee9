"""Which served model takes an admitted request, and what it reserves there.

:class:`ModelRouter` holds, per served model name, its engine, its waiting queue
(:class:`~llmserve.gateway.admission.controller.AdmissionController`) and its live-KV gate
(:class:`~llmserve.gateway.admission.kv.KVAdmission`); names that share an engine
share both. :meth:`ModelRouter.enter` commits the request's KV blocks and takes a
queue place on the requested model or, when that one is overloaded (queue full or KV
pressure) and the tenant may use it, on the configured fallback model.
:meth:`ModelRouter.completion_reservation` decides how many completion tokens a
request reserves against rate limits, the queue and the KV gate. No torch here.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from llmserve.contract.engine_client import EngineClient
from llmserve.contract.gateway_hook import RequestContext
from llmserve.gateway.admission.controller import AdmissionController, QueueTicket
from llmserve.gateway.admission.kv import KVAdmission, KVCommitment, blocks_needed, kv_admission_for
from llmserve.gateway.auth import Authenticator
from llmserve.gateway.config.gateway_config import GatewayConfig, TenantConfig
from llmserve.gateway.errors import GatewayError, OverloadedError


@dataclass
class ServedModel:
    """One served model name: its engine, its queue and its live-KV gate."""

    name: str
    engine: EngineClient
    admission: AdmissionController
    kv: Optional[KVAdmission] = None


@dataclass
class Placement:
    """Where an admitted request went: the model, its queue place and its KV commitment."""

    model: ServedModel
    ticket: QueueTicket
    kv: Optional[KVCommitment]


class ModelRouter:
    """Served models of one gateway (see the module docstring).

    Args:
        config: the gateway config (queue bounds, KV watermark, reservation).
        models: served model name -> engine.
        auth: the tenants' model permissions (fallback rights).
    """

    def __init__(self, config: GatewayConfig, models: Mapping[str, Any], auth: Authenticator) -> None:
        self.config = config
        self.auth = auth
        by_engine: dict[int, tuple[AdmissionController, Optional[KVAdmission]]] = {}
        self.models: dict[str, ServedModel] = {}
        for name, engine in models.items():
            if id(engine) not in by_engine:
                stats = engine.get_stats()
                by_engine[id(engine)] = (AdmissionController.from_config(
                    config.queue, kv_pool_tokens=stats.kv_blocks_total * engine.block_size,
                    max_model_len=engine.max_model_len, block_size=engine.block_size),
                    kv_admission_for(engine, config.queue.kv_watermark, config.queue.timeout_s))
            self.models[name] = ServedModel(name, engine, *by_engine[id(engine)])

    def add_alias(self, name: str, engine: EngineClient, like: str) -> None:
        """Serve ``name`` (a LoRA adapter on ``like``'s engine) through ``like``'s queue
        and KV gate: they share one engine, so they share its capacity."""
        base = self.models.get(like)
        if base is None:
            raise ValueError(f"model {like!r} is not served")
        self.models[name] = ServedModel(name, engine, base.admission, base.kv)

    def remove(self, name: str) -> None:
        """Stop routing to ``name`` (an unloaded adapter); unknown names are ignored."""
        self.models.pop(name, None)

    def get(self, name: Optional[str]) -> Optional[ServedModel]:
        """The served model of this name, or None."""
        return self.models.get(name or "")

    def completion_reservation(self, tenant: TenantConfig, ctx: RequestContext) -> int:
        """Completion tokens per choice reserved against rate limits, queue and KV.

        ``max_tokens`` when the client set it. Without it the request may still run to
        the end of the context (as with OpenAI and vLLM), but only
        ``max_tokens_reservation`` is reserved -- and never so much that the implicit
        amount alone overflows the tenant's token bucket -- then settled to actual use.
        """
        if ctx.max_tokens_requested is not None:
            return ctx.max_tokens
        reserve = min(ctx.max_tokens, self.config.max_tokens_reservation)
        capacity = tenant.token_burst or tenant.tokens_per_minute
        if capacity is not None:
            room = (capacity - ctx.prompt_tokens) // max(1, ctx.num_choices)
            reserve = min(reserve, max(1, room))
        return max(1, reserve)

    def _fallback(self, tenant: TenantConfig, primary: ServedModel,
                  ctx: RequestContext) -> Optional[ServedModel]:
        """The fallback model for an overloaded request, if the tenant may use one and
        it could ever run the request there (never to dodge a 400)."""
        name = self.auth.may_use_fallback(tenant, primary.name)
        fallback = self.models.get(name) if name else None
        if fallback is None or fallback.admission is primary.admission:
            return None
        try:
            fallback.admission.check_request(ctx.longest_prompt_tokens, ctx.max_tokens)
        except GatewayError:
            return None
        return fallback

    @staticmethod
    def _place(model: ServedModel, ctx: RequestContext, tokens: int, reserve: int) -> Placement:
        """Commit KV blocks (503 ``kv_cache_pressure``) and take a queue place (503)."""
        kv = None
        if model.kv is not None:
            kv = model.kv.commit(blocks_needed(ctx.prompt_tokens, ctx.num_choices, reserve,
                                               model.engine.block_size))
        try:
            ticket = model.admission.enter_queue(tokens)
        except BaseException:
            if kv is not None:
                kv.release()
            raise
        return Placement(model, ticket, kv)

    def enter(self, tenant: TenantConfig, primary: ServedModel, ctx: RequestContext,
              tokens: int, reserve: int) -> Placement:
        """Place the request on the primary or, on overload (queue or KV), the tenant's
        fallback; raises OverloadedError (503) when neither can take it now."""
        if primary.admission.would_overload(tokens):
            fallback = self._fallback(tenant, primary, ctx)
            if fallback is not None and not fallback.admission.would_overload(tokens):
                with contextlib.suppress(OverloadedError):
                    return self._place(fallback, ctx, tokens, reserve)
        try:
            return self._place(primary, ctx, tokens, reserve)
        except OverloadedError:
            fallback = self._fallback(tenant, primary, ctx)
            if fallback is None:
                raise
            return self._place(fallback, ctx, tokens, reserve)
