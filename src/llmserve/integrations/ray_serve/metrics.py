"""Per-replica Prometheus series of a Ray Serve deployment, at the ingress's ``/metrics``.

The same names as behind ``llmserve router`` (docs/SCALING.md, "Metrics"), labelled by the
Ray replica id: ``llmserve_replica_*{replica}`` (each replica's engine series, from its
routing stats) and ``llmserve_router_decisions_total{replica, decision}`` (this ingress's
request router). The unlabelled engine series are the sums over replicas.
"""
from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from llmserve.router.metrics import add_replica_samples
from llmserve.router.replica_set import DECISIONS


class RayReplicaCollector(Collector):
    """Reads the client's replica stats and router decisions at scrape time."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def collect(self) -> Iterator[Any]:
        from llmserve.integrations.ray_serve.router_registry import router_decisions
        handle = self._client._handle  # noqa: SLF001 - the deployment this client routes to
        decisions = CounterMetricFamily("llmserve_router_decisions",
                                        "Requests routed to a replica, by decision",
                                        labels=("replica", "decision"))
        for name, counts in sorted(router_decisions(handle.app_name,
                                                    handle.deployment_name).items()):
            for decision in DECISIONS:
                decisions.add_metric([name, decision], counts.get(decision, 0))
        yield decisions
        families: dict[str, Any] = {}
        for name, stats in sorted(self._client.replica_stats().items()):
            add_replica_samples(families, name, stats)
        yield from families.values()
