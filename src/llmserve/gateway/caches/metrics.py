"""Prometheus metrics of the response cache and of prompt-bundle pinning, read at scrape time.

    llmserve_response_cache_requests_total{tenant, result}  hit | miss | bypass | stored
    llmserve_response_cache_entries / _bytes                what the store holds now
    llmserve_response_cache_evictions_total                 entries evicted by the bounds
    llmserve_prompt_bundle_pinned_blocks{tenant}            KV blocks pinned for bundles
    llmserve_prompt_bundle_pin_budget_blocks{tenant}        the tenant's pinning budget
    llmserve_prompt_bundle_requests_total{tenant}           requests that used a bundle
    llmserve_prompt_bundle_hit_tokens_total{tenant}         their bundle-prefix tokens served
                                                            from the prefix cache

``tenant`` comes from the config, so the label is bounded, but /metrics needs no key: the
``tenant`` label is exported only with ``metrics: {per_tenant: true}`` in the gateway config.
By default each family is one series summed over the tenants (``result`` stays). No torch.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)


class CacheMetricsCollector(Collector):
    """The metrics of the module docstring for one gateway."""

    def __init__(self, caches: Any, config: Any, per_tenant: bool = False) -> None:
        self.caches = caches
        self.config = config
        self.per_tenant = per_tenant

    def _labels(self, *rest: str) -> list[str]:
        return (["tenant"] if self.per_tenant else []) + list(rest)

    def _add(self, family: Any, tenant: str, rest: list[str], value: float,
             sums: dict[tuple[str, ...], float]) -> None:
        """One tenant's sample: as its own series, or into the family's sum."""
        if self.per_tenant:
            family.add_metric([tenant, *rest], value)
        else:
            sums[tuple(rest)] = sums.get(tuple(rest), 0) + value

    @staticmethod
    def _flush(family: Any, sums: dict[tuple[str, ...], float]) -> None:
        for rest, value in sorted(sums.items()):
            family.add_metric(list(rest), value)

    def collect(self) -> Iterator[Any]:
        yield from self._response_cache()
        yield from self._bundles()

    def _response_cache(self) -> Iterator[Any]:
        cache = self.caches.response_cache
        requests = CounterMetricFamily("llmserve_response_cache_requests",
                                       "Response-cache outcomes of requests (by tenant with "
                                       "metrics.per_tenant)", labels=self._labels("result"))
        entries = GaugeMetricFamily("llmserve_response_cache_entries",
                                    "Answers held by the response cache")
        size = GaugeMetricFamily("llmserve_response_cache_bytes",
                                 "Bytes of the answers held by the response cache")
        evictions = CounterMetricFamily("llmserve_response_cache_evictions",
                                        "Answers evicted by the response cache's bounds")
        if cache is not None:
            sums: dict[tuple[str, ...], float] = {}
            for (tenant, result), n in sorted(dict(cache.counts).items()):
                self._add(requests, tenant, [result], n, sums)
            self._flush(requests, sums)
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
                                   "KV blocks pinned for prompt bundles",
                                   labels=self._labels())
        budget = GaugeMetricFamily("llmserve_prompt_bundle_pin_budget_blocks",
                                   "Budget of pinned KV blocks", labels=self._labels())
        uses = CounterMetricFamily("llmserve_prompt_bundle_requests",
                                   "Requests that used a prompt bundle", labels=self._labels())
        hits = CounterMetricFamily("llmserve_prompt_bundle_hit_tokens",
                                   "Bundle-prefix tokens of those requests served from the "
                                   "prefix cache", labels=self._labels())
        by_tenant: dict[str, list[int]] = {}
        for pin in self.caches.kv.snapshot():
            totals = by_tenant.setdefault(pin["tenant"], [0, 0])
            totals[0] += pin["requests"]
            totals[1] += pin["hit_tokens"]
        sums: list[dict[tuple[str, ...], float]] = [{}, {}, {}, {}]
        for tenant in self.config.tenants.values():
            n, h = by_tenant.get(tenant.name, (0, 0))
            values = (self.caches.kv.pinned_blocks(tenant.name),
                      self.config.bundle_budget(tenant), n, h)
            for family, value, acc in zip((pinned, budget, uses, hits), values, sums):
                self._add(family, tenant.name, [], value, acc)
        for family, acc in zip((pinned, budget, uses, hits), sums):
            self._flush(family, acc)
        yield from (pinned, budget, uses, hits)
