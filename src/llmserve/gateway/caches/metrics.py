"""Prometheus metrics of the response cache and of prompt-bundle pinning, read at scrape time.

    llmserve_response_cache_requests_total{tenant, result}  hit | miss | bypass | stored
    llmserve_response_cache_entries / _bytes                what the store holds now
    llmserve_response_cache_evictions_total                 entries evicted by the bounds
    llmserve_prompt_bundle_pinned_blocks{tenant}            KV blocks pinned for bundles
    llmserve_prompt_bundle_pin_budget_blocks{tenant}        the tenant's pinning budget
    llmserve_prompt_bundle_requests_total{tenant}           requests that used a bundle
    llmserve_prompt_bundle_hit_tokens_total{tenant}         their bundle-prefix tokens served
                                                            from the prefix cache

``tenant`` comes from the config, so the label is bounded. No torch.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)


class CacheMetricsCollector(Collector):
    """The metrics of the module docstring for one gateway."""

    def __init__(self, caches: Any, config: Any) -> None:
        self.caches = caches
        self.config = config

    def collect(self) -> Iterator[Any]:
        yield from self._response_cache()
        yield from self._bundles()

    def _response_cache(self) -> Iterator[Any]:
        cache = self.caches.response_cache
        requests = CounterMetricFamily("llmserve_response_cache_requests",
                                       "Response-cache outcomes of requests, by tenant",
                                       labels=["tenant", "result"])
        entries = GaugeMetricFamily("llmserve_response_cache_entries",
                                    "Answers held by the response cache")
        size = GaugeMetricFamily("llmserve_response_cache_bytes",
                                 "Bytes of the answers held by the response cache")
        evictions = CounterMetricFamily("llmserve_response_cache_evictions",
                                        "Answers evicted by the response cache's bounds")
        if cache is not None:
            for (tenant, result), n in sorted(dict(cache.counts).items()):
                requests.add_metric([tenant, result], n)
            try:
                held, nbytes = cache.store.usage()
            except Exception:  # noqa: BLE001 - a failing store must not break /metrics
                logger.exception("response cache usage failed during a metrics scrape")
                held, nbytes = 0, 0
            entries.add_metric([], held)
            size.add_metric([], nbytes)
            evictions.add_metric([], cache.store.evictions)
        yield from (requests, entries, size, evictions)

    def _bundles(self) -> Iterator[Any]:
        pinned = GaugeMetricFamily("llmserve_prompt_bundle_pinned_blocks",
                                   "KV blocks pinned for the tenant's prompt bundles",
                                   labels=["tenant"])
        budget = GaugeMetricFamily("llmserve_prompt_bundle_pin_budget_blocks",
                                   "The tenant's budget of pinned KV blocks", labels=["tenant"])
        uses = CounterMetricFamily("llmserve_prompt_bundle_requests",
                                   "Requests that used a prompt bundle", labels=["tenant"])
        hits = CounterMetricFamily("llmserve_prompt_bundle_hit_tokens",
                                   "Bundle-prefix tokens of those requests served from the "
                                   "prefix cache", labels=["tenant"])
        by_tenant: dict[str, list[int]] = {}
        for pin in self.caches.kv.snapshot():
            totals = by_tenant.setdefault(pin["tenant"], [0, 0])
            totals[0] += pin["requests"]
            totals[1] += pin["hit_tokens"]
        for tenant in self.config.tenants.values():
            pinned.add_metric([tenant.name], self.caches.kv.pinned_blocks(tenant.name))
            budget.add_metric([tenant.name], self.config.bundle_budget(tenant))
            n, h = by_tenant.get(tenant.name, (0, 0))
            uses.add_metric([tenant.name], n)
            hits.add_metric([tenant.name], h)
        yield from (pinned, budget, uses, hits)
