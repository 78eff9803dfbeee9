"""``build_gateway``: a :class:`~llmserve.gateway.hook.TenantGateway` from a config file.

Builds the ledger and idempotency store (the config's ``database``), the response
cache (when a tenant opted in), the prompt-bundle registry (persisted in the same
database), and sets the engines' prefix-hit audit sample rate. No torch.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence

from llmserve.contract.engine_client import EngineClient
from llmserve.gateway.billing.idempotency import IdempotencyStore
from llmserve.gateway.billing.ledger import BillingLedger
from llmserve.gateway.caches.prompt_bundles import BundleRegistry
from llmserve.gateway.caches.response_cache import ResponseCache
from llmserve.gateway.config.gateway_config import GatewayConfig
from llmserve.gateway.hook import TenantGateway

logger = logging.getLogger(__name__)


def build_gateway(config_path: str, engine: EngineClient, *, fallback_engines: Optional[Mapping[str, EngineClient]] = None,
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
    response_cache = None
    if any(t.response_cache for t in config.tenants.values()):
        response_cache = ResponseCache.build(config.response_cache, config.database)
    bundles = BundleRegistry(config.database, config.prompt_bundles.max_versions,
                             config.prompt_bundles.max_bundles_per_tenant)
    gateway = TenantGateway(config, models, ledger=ledger, store=store,
                            response_cache=response_cache, bundles=bundles)
    for eng in {id(e): e for e in models.values()}.values():
        configure = getattr(eng, "engine", None)
        if configure is not None and hasattr(configure, "set_cache_audit_rate"):
            configure.set_cache_audit_rate(config.cache_audit.sample_rate)
    return gateway
