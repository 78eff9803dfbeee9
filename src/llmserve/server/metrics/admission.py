"""Metrics of what the server refused or cut short, and per-namespace prefix-cache counters.

* ``llmserve_requests_rejected_total{reason}``: generation requests answered with an
  error instead of a completion, by bounded reason (:func:`rejection_reason`);
* ``llmserve_cancel_to_kv_freed_seconds``: from the moment the server cancels a
  request in the engine (client gone, error) to the engine's confirmation that the
  request's KV blocks are free;
* ``llmserve_prefix_cache_namespace_queries_total{cache_namespace}`` and
  ``..._hits_total{cache_namespace}``: the engine's prefix-cache counters per cache
  namespace (a gateway tenant's ``tenant:<name>``, a shared ``shared:<name>``, or
  ``none``), from ``EngineStats.prefix_*_tokens_by_tenant`` (filled by the engine
  collector of server/metrics/prometheus.py from the same snapshot as the other engine series). The
  namespaces come from the gateway config, so the label is bounded; past
  :data:`MAX_NAMESPACES` series per engine the rest are summed under ``other``.

Exact definitions: docs/METRICS.md. No torch here.
"""
from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily

#: Every value of the ``reason`` label of ``llmserve_requests_rejected_total``.
REJECTION_REASONS = ("auth", "rate_limit", "queue_full", "kv_pressure", "too_large", "timeout",
                     "queue_timeout", "idempotency", "invalid", "unavailable", "error")
#: Most ``cache_namespace`` series exported per engine; the rest are summed as "other".
MAX_NAMESPACES = 256

_CANCEL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
_BY_CODE_503 = {"server_overloaded": "queue_full", "kv_cache_pressure": "kv_pressure",
                "queue_timeout": "queue_timeout", "timeout": "timeout"}


def rejection_reason(status: int, code: Optional[str]) -> str:
    """The bounded ``reason`` label of an error response with this status and code."""
    if status in (401, 403):
        return "auth"
    if status == 429:
        return "rate_limit"
    if status == 413:
        return "too_large"
    if status == 408:
        return "timeout"
    if status == 503:
        return _BY_CODE_503.get(code or "", "unavailable")
    if status in (409, 422) and (code or "").startswith("idempotency"):
        return "idempotency"
    return "error" if status >= 500 else "invalid"


class AdmissionMetrics:
    """The rejection counter and the cancel-to-KV-freed histogram of one app."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, ...],
                 label_values: tuple[str, ...]) -> None:
        self._lv = label_values
        self._rejected = Counter("llmserve_requests_rejected",
                                 "Generation requests answered with an error, by reason",
                                 labels + ("reason",), registry=registry)
        for reason in REJECTION_REASONS:  # export zeros, so rates work from the start
            self._rejected.labels(*label_values, reason)
        self.cancel_to_kv_freed = Histogram(
            "llmserve_cancel_to_kv_freed_seconds",
            "From the server cancelling a request to the engine confirming its KV blocks free",
            labels, buckets=_CANCEL_BUCKETS, registry=registry).labels(*label_values)

    def count_rejected(self, status: int, code: Optional[str]) -> None:
        """Count one rejected request (see :func:`rejection_reason`)."""
        self._rejected.labels(*self._lv, rejection_reason(status, code)).inc()


def namespace_families(labels: tuple[str, ...]) -> tuple[Any, Any]:
    """The two per-namespace prefix-cache counter families (queries, hits), empty."""
    names = list(labels) + ["cache_namespace"]
    return (CounterMetricFamily("llmserve_prefix_cache_namespace_queries",
                                "Prompt tokens looked up in the prefix cache, by cache namespace",
                                labels=names),
            CounterMetricFamily("llmserve_prefix_cache_namespace_hits",
                                "Prompt tokens found in the prefix cache, by cache namespace",
                                labels=names))


def add_namespace_samples(queries: Any, hits: Any, stats: Any, label_values: list[str]) -> None:
    """One engine's per-namespace counters from its stats snapshot (at most MAX_NAMESPACES
    namespaces, the rest as "other")."""
    query_by = dict(getattr(stats, "prefix_query_tokens_by_tenant", None) or {})
    hit_by = dict(getattr(stats, "prefix_hit_tokens_by_tenant", None) or {})
    for name, (queried, hit) in _bounded(query_by, hit_by).items():
        queries.add_metric(label_values + [name], queried)
        hits.add_metric(label_values + [name], hit)


def _bounded(query_by: dict[str, int], hit_by: dict[str, int]) -> dict[str, tuple[int, int]]:
    """namespace -> (queries, hits); beyond MAX_NAMESPACES, the rest summed as "other"."""
    out: dict[str, tuple[int, int]] = {}
    for i, salt in enumerate(sorted(set(query_by) | set(hit_by))):
        name = (salt or "none") if i < MAX_NAMESPACES else "other"
        q, h = out.get(name, (0, 0))
        out[name] = (q + query_by.get(salt, 0), h + hit_by.get(salt, 0))
    return out
