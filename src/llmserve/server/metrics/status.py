"""``GET /v1/status``: what the live dashboard draws, from the same series as ``/metrics``.

Each call reads the app's Prometheus registry once (so the figures are exactly the
``llmserve_*`` series of docs/METRICS.md, summed over served models) and keeps the
sample in a ring buffer, at most one sample per ``min_interval_s``. The answer holds
the newest figures and, over the last ``window`` seconds of samples:

* a time series (running, waiting, KV blocks used, prompt and generated tokens/s);
* the prefix-cache hit rate (hit tokens / looked-up tokens) and the preemptions;
* TTFT and inter-token latency percentiles (p50, p90, p99) from the histogram buckets'
  increase over the window, interpolated inside a bucket as Prometheus'
  ``histogram_quantile`` does;

The window's increases run from the newest sample at or before its start (the reading
taken when the app was built is the first), so after a gap in polling they cover more
than the window; ``window_s`` says how many seconds they cover.
* with a gateway and an admin Bearer key: usage per tenant from the billing ledger;
* ``kernel_plan``: per served model, which kernel runs each operation (decided at start-up).

Besides that first reading, the buffer fills while someone polls (the dashboard polls
every second); no thread runs in the background. No torch.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from llmserve.contract.engine_client import KernelPlanReport
from llmserve.contract.errors import OpenAIError
from llmserve.contract.gateway_hook import Gateway, HTTPCall

logger = logging.getLogger(__name__)

#: Gauges and counters kept per sample: short name -> exported sample name.
SCALARS = {
    "running": "llmserve_num_requests_running",
    "waiting": "llmserve_num_requests_waiting",
    "kv_blocks_used": "llmserve_kv_cache_blocks_used",
    "kv_blocks_total": "llmserve_kv_cache_blocks_total",
    "in_progress": "llmserve_generation_requests_in_progress",
    "prompt_tokens": "llmserve_prompt_tokens_total",
    "generation_tokens": "llmserve_generation_tokens_total",
    "prefix_queries": "llmserve_prefix_cache_queries_total",
    "prefix_hits": "llmserve_prefix_cache_hits_total",
    "preemptions": "llmserve_num_preemptions_total",
    "aborted": "llmserve_request_aborted_total",
    "rejected": "llmserve_requests_rejected_total",
}
#: Latency histograms kept per sample (their ``_bucket`` series).
HISTOGRAMS = {
    "ttft": "llmserve_time_to_first_token_seconds",
    "itl": "llmserve_inter_token_latency_seconds",
}
QUANTILES = (0.5, 0.9, 0.99)
DEFAULT_WINDOW_S = 300.0
MAX_WINDOW_S = 1800.0


def parse_window(raw: Optional[str]) -> float:
    """The ``window`` query parameter: seconds, 10 to 1800 (default 300); 400 otherwise."""
    if raw is None or raw == "":
        return DEFAULT_WINDOW_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 10 <= value <= MAX_WINDOW_S:
        raise OpenAIError(400, f"window must be a number of seconds from 10 to {MAX_WINDOW_S:g}",
                          param="window", code="invalid_window")
    return value


@dataclass
class Sample:
    """One reading of the registry: gauges/counters by short name, histogram buckets as
    (upper bound, cumulative count) sorted by bound."""

    t: float
    wall: float
    values: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def read_sample(registry: Any, now: float, wall: float) -> Sample:
    """Sum every series of :data:`SCALARS` and :data:`HISTOGRAMS` over its labels."""
    sample = Sample(now, wall, {k: 0.0 for k in SCALARS})
    by_name = {v: k for k, v in SCALARS.items()}
    bucket_names = {v + "_bucket": k for k, v in HISTOGRAMS.items()}
    sums: dict[str, dict[float, float]] = {k: {} for k in HISTOGRAMS}
    for family in registry.collect():
        for s in family.samples:
            if s.name in by_name:
                sample.values[by_name[s.name]] += float(s.value)
            elif s.name in bucket_names:
                le = float(s.labels["le"])
                counts = sums[bucket_names[s.name]]
                counts[le] = counts.get(le, 0.0) + float(s.value)
    sample.buckets = {k: sorted(v.items()) for k, v in sums.items()}
    return sample


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> Optional[float]:
    """The ``q`` quantile of cumulative ``buckets`` (last bound +Inf), or None when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _increase(new: list[tuple[float, float]], old: list[tuple[float, float]]
              ) -> list[tuple[float, float]]:
    before = dict(old)
    return [(bound, max(0.0, count - before.get(bound, 0.0))) for bound, count in new]


def _rate(new: Sample, old: Sample, key: str) -> float:
    dt = new.t - old.t
    return max(0.0, new.values[key] - old.values[key]) / dt if dt > 0 else 0.0


class StatusSampler:
    """The ring buffer behind ``GET /v1/status`` (see the module docstring).

    Args:
        registry: the app's Prometheus registry (``ServerMetrics.registry``).
        gateway: the app's gateway hook or None; per-tenant usage needs its ``admin``
            (admin-key check) and ``ledger`` (usage records).
        min_interval_s: samples closer together than this are not kept.
        clock, wall_clock: injectable ``time.monotonic`` and ``time.time``.
    """

    def __init__(self, registry: Any, gateway: Optional[Gateway] = None, min_interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 engines: Optional[dict[str, Any]] = None) -> None:
        self.registry = registry
        self.gateway = gateway
        #: served model name -> engine; those with a kernel plan report it
        self.engines = engines or {}
        self.min_interval_s = min_interval_s
        self._clock, self._wall = clock, wall_clock
        self._samples: collections.deque[Sample] = collections.deque(
            maxlen=int(MAX_WINDOW_S / min_interval_s) + 2)
        self._lock = asyncio.Lock()
        # the reading at startup: the first window's increases count from here
        try:
            self._samples.append(read_sample(registry, clock(), wall_clock()))
        except Exception:  # noqa: BLE001 - a failing collector must not stop the app
            logger.exception("reading the metrics registry for /v1/status failed")

    async def sample(self) -> Sample:
        """Read the registry now; keep the reading unless the last one is too recent."""
        async with self._lock:
            now = self._clock()
            latest = await asyncio.to_thread(read_sample, self.registry, now, self._wall())
            if not self._samples or now - self._samples[-1].t >= self.min_interval_s:
                self._samples.append(latest)
            return latest

    async def snapshot(self, window: float = DEFAULT_WINDOW_S,
                       authorization: Optional[str] = None) -> dict[str, Any]:
        """The JSON body of ``GET /v1/status``; 401/403 for a Bearer key that is not an
        admin key when a gateway is configured."""
        is_admin = self._check_admin(authorization)
        latest = await self.sample()
        first = self._baseline(latest.t - window)
        v = latest.values
        queries = v["prefix_queries"] - first.values["prefix_queries"]
        hits = v["prefix_hits"] - first.values["prefix_hits"]
        body: dict[str, Any] = {
            "object": "status",
            "time": latest.wall,
            "window_s": round(latest.t - first.t, 3),
            "now": {k: v[k] for k in ("running", "waiting", "in_progress", "kv_blocks_used",
                                      "kv_blocks_total")},
            "totals": {k: v[k] for k in ("prompt_tokens", "generation_tokens", "preemptions",
                                         "aborted", "rejected", "prefix_queries", "prefix_hits")},
            "window": {
                "prefix_cache_hit_rate": hits / queries if queries > 0 else None,
                "preemptions": v["preemptions"] - first.values["preemptions"],
                "aborted": v["aborted"] - first.values["aborted"],
                "rejected": v["rejected"] - first.values["rejected"],
                "prompt_tokens_per_s": _rate(latest, first, "prompt_tokens"),
                "generation_tokens_per_s": _rate(latest, first, "generation_tokens"),
            },
            "latency": {name: self._percentiles(latest, first, name) for name in HISTOGRAMS},
            "series": self._series(list(self._samples), latest.t - window),
            "gateway": self.gateway is not None,
            "admin": is_admin,
            "kernel_plan": {name: eng.kernel_plan() for name, eng in self.engines.items()
                            if isinstance(eng, KernelPlanReport)},
        }
        if is_admin:
            body["tenants"] = await asyncio.to_thread(self._tenant_usage, latest.wall - window)
        return body

    def _baseline(self, start: float) -> Sample:
        """The newest sample taken at or before ``start``, else the oldest one: the
        window's figures are increases since it (so after a gap in polling they cover
        more than the window; ``window_s`` says how much)."""
        before = [s for s in self._samples if s.t <= start]
        return before[-1] if before else self._samples[0]

    @staticmethod
    def _percentiles(latest: Sample, first: Sample, name: str) -> dict[str, Any]:
        buckets = latest.buckets.get(name, [])
        if first is not latest:
            buckets = _increase(buckets, first.buckets.get(name, []))
        out: dict[str, Any] = {f"p{round(q * 100)}": histogram_quantile(q, buckets)
                               for q in QUANTILES}
        out["count"] = buckets[-1][1] if buckets else 0.0
        return out

    @staticmethod
    def _series(samples: list[Sample], start: float) -> list[dict[str, float]]:
        """The kept samples from ``start`` on, each with the token rates since the
        sample before it."""
        points = []
        for i, cur in enumerate(samples):
            if cur.t < start:
                continue
            prev = samples[i - 1] if i else None
            points.append({
                "t": round(cur.wall, 3), "running": cur.values["running"],
                "waiting": cur.values["waiting"], "kv_blocks_used": cur.values["kv_blocks_used"],
                "prompt_tokens_per_s": _rate(cur, prev, "prompt_tokens") if prev else 0.0,
                "generation_tokens_per_s": (_rate(cur, prev, "generation_tokens")
                                            if prev else 0.0)})
        return points

    def _check_admin(self, authorization: Optional[str]) -> bool:
        admin = getattr(self.gateway, "admin", None)
        if authorization is None or admin is None:
            return False
        call = HTTPCall(method="GET", path="/v1/status", headers={"authorization": authorization},
                        path_params={}, query={}, body=b"")
        if not admin.is_admin(call):
            raise OpenAIError(403, "per-tenant status needs an admin key (`admin.keys` in the "
                              "gateway config); send no key for the server-wide figures",
                              code="admin_key_required")
        return True

    def _tenant_usage(self, since: float) -> dict[str, dict[str, Any]]:
        """Requests and tokens per configured tenant since ``since`` (wall clock)."""
        config = getattr(self.gateway, "config", None)
        names = list(getattr(config, "tenants", {}) or {})
        usage = {n: {"requests": 0, "errors": 0, "prompt_tokens": 0, "cached_tokens": 0,
                     "completion_tokens": 0} for n in names}
        ledger = getattr(self.gateway, "ledger", None)
        if ledger is None:
            return usage
        for rec in ledger.records(since=since):
            row = usage.setdefault(rec.tenant, {"requests": 0, "errors": 0, "prompt_tokens": 0,
                                                "cached_tokens": 0, "completion_tokens": 0})
            row["requests"] += 1
            row["errors"] += int(rec.status >= 400)
            row["prompt_tokens"] += rec.prompt_tokens
            row["cached_tokens"] += rec.cached_tokens
            row["completion_tokens"] += rec.completion_tokens
        return usage
