"""Prometheus series of the router, each with a ``replica`` label (no torch).

* ``llmserve_router_decisions_total{replica, decision}``: requests sent to a replica, by
  why (``affinity``, ``fallback``, ``round_robin``, ``least_loaded``); a retry counts a
  second decision.
* ``llmserve_router_retries_total{replica}``: requests that failed on that replica before
  their first increment and were retried elsewhere.
* ``llmserve_router_ejections_total{replica}``, ``llmserve_router_readmissions_total``.
* ``llmserve_router_replica_admitted{replica}`` (1/0),
  ``llmserve_router_replica_outstanding_tokens{replica}``.
* ``llmserve_replica_*{replica}``: the replica's own engine gauges and counters as last
  polled (the same names as the server's ``llmserve_*`` engine series, e.g.
  ``llmserve_replica_prefix_cache_hits``), so per-replica hit rates are visible.
"""
from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmserve.router.replica_set import DECISIONS, ReplicaSet


class RouterCollector(Collector):
    """Reads the replica set at scrape time."""

    def __init__(self, replica_set: ReplicaSet) -> None:
        self._set = replica_set

    def collect(self) -> Iterator[Any]:

        decisions = CounterMetricFamily("llmserve_router_decisions",
                                        "Requests routed to a replica, by decision",
                                        labels=("replica", "decision"))
        retries = CounterMetricFamily(
            "llmserve_router_retries",
            "Requests that failed on the replica before their first token, retried elsewhere",
            labels=("replica",))
        ejections = CounterMetricFamily("llmserve_router_ejections",
                                        "Times the replica was ejected", labels=("replica",))
        readmissions = CounterMetricFamily("llmserve_router_readmissions",
                                           "Times the replica was re-admitted",
                                           labels=("replica",))
        admitted = GaugeMetricFamily("llmserve_router_replica_admitted",
                                     "1 while the replica takes new requests",
                                     labels=("replica",))
        outstanding = GaugeMetricFamily(
            "llmserve_router_replica_outstanding_tokens",
            "Prompt and output tokens of the router's requests still to run there",
            labels=("replica",))
        per_replica: dict[str, Any] = {}
        with self._set.lock:
            snapshot = [(r.name, dict(r.decisions), r.retries_from, r.ejections,
                         r.readmissions, r.admitted, r.outstanding_tokens, r.stats)
                        for r in self._set.replicas]
        for name, dec, retried, ejected, readmitted, ok, tokens, stats in snapshot:
            for decision in DECISIONS:
                decisions.add_metric([name, decision], dec.get(decision, 0))
            retries.add_metric([name], retried)
            ejections.add_metric([name], ejected)
            readmissions.add_metric([name], readmitted)
            admitted.add_metric([name], 1.0 if ok else 0.0)
            outstanding.add_metric([name], tokens)
            add_replica_samples(per_replica, name, stats)
        yield from (decisions, retries, ejections, readmissions, admitted, outstanding)
        yield from per_replica.values()


def add_replica_samples(families: dict[str, Any], replica: str, stats: Any) -> None:
    """Add one replica's engine stats to ``families`` as ``llmserve_replica_*`` series
    labelled ``replica`` (one family per metric, made on first use)."""
    from llmserve.server.metrics.prometheus import EngineStatsCollector

    for kind, metric, doc, value in EngineStatsCollector._samples(stats):  # noqa: SLF001
        metric = metric.replace("llmserve_", "llmserve_replica_", 1)
        family = families.get(metric)
        if family is None:
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = families[metric] = cls(metric, doc + " (one replica)",
                                            labels=("replica",))
        family.add_metric([replica], value)
