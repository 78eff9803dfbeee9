"""Prometheus metrics of releases, read at scrape time (labels come from the config, so
they are bounded):

    llmserve_release_info{model, release, target, fingerprint}   1 per configured release
    llmserve_release_share{model, release}                       live traffic share (0..1)
    llmserve_release_in_flight{model, release}                   admitted requests running
    llmserve_release_requests_total{model, release, outcome}     ok | error, since start
    llmserve_release_error_rate{model, release}                  over the health window
    llmserve_release_ttft_p95_seconds{model, release}            over the health window
    llmserve_release_tpot_p95_seconds{model, release}            over the health window
    llmserve_release_shadow_agreement{model, release}            mean token agreement (window)
    llmserve_release_shadow_requests_total{model, release, result}  compared | error | skipped
    llmserve_release_rollbacks_total{model, release, reason}     error_rate | ttft_p95 |
                                                                 tpot_p95 | shadow_agreement |
                                                                 manual

No torch.
"""
from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class ReleaseMetricsCollector(Collector):
    """The metrics of the module docstring for one gateway's releases."""

    def __init__(self, releases: Any) -> None:
        self.releases = releases

    def collect(self) -> Iterator[Any]:
        labels = ["model", "release"]
        info = GaugeMetricFamily("llmserve_release_info", "Configured releases and their "
                                 "fingerprints", labels=labels + ["target", "fingerprint"])
        share = GaugeMetricFamily("llmserve_release_share", "Live traffic share of a release",
                                  labels=labels)
        inflight = GaugeMetricFamily("llmserve_release_in_flight",
                                     "Admitted requests running on a release", labels=labels)
        requests = CounterMetricFamily("llmserve_release_requests", "Finished requests per "
                                       "release", labels=labels + ["outcome"])
        gauges = {key: GaugeMetricFamily(name, doc, labels=labels) for key, name, doc in (
            ("error_rate", "llmserve_release_error_rate", "Failed share over the health window"),
            ("ttft_p95_s", "llmserve_release_ttft_p95_seconds", "TTFT p95 over the window"),
            ("tpot_p95_s", "llmserve_release_tpot_p95_seconds", "TPOT p95 over the window"),
            ("shadow_agreement", "llmserve_release_shadow_agreement",
             "Mean shadow token agreement over the window"))}
        shadow = CounterMetricFamily("llmserve_release_shadow_requests", "Mirrored requests "
                                     "by result", labels=labels + ["result"])
        rollbacks = CounterMetricFamily("llmserve_release_rollbacks", "Canary rollbacks",
                                        labels=labels + ["reason"])
        table, health = self.releases.table, self.releases.health
        for model, state in table.models.items():
            split = state.snapshot()
            window = state.config.health.window_s
            for rid in state.config.versions:
                release = state.releases.get(rid)
                if release is not None:
                    info.add_metric([model, rid, release.target, release.fingerprint], 1)
                value = split["canary_share"] if rid == split["canary"] else 0.0
                if rid == split["stable"]:
                    value = 1.0 - split["canary_share"]
                share.add_metric([model, rid], value)
                inflight.add_metric([model, rid], table.inflight.get(rid, 0))
                for outcome in ("ok", "error"):
                    requests.add_metric([model, rid, outcome], health.totals[(rid, outcome)])
                stats = health.stats(rid, window)
                for key, family in gauges.items():
                    if stats[key] is not None:
                        family.add_metric([model, rid], stats[key])
                for result in ("compared", "error", "skipped"):
                    shadow.add_metric([model, rid, result],
                                      self.releases.shadow.counts[(rid, result)])
        for (model, rid, reason), n in sorted(self.releases.rollbacks.items()):
            rollbacks.add_metric([model, rid, reason], n)
        yield from (info, share, inflight, requests, *gauges.values(), shadow, rollbacks)
