"""Prometheus metrics of the server (``llmserve_*``), one private registry per app.

Latency histograms are observed by the server as it consumes the engine's output
stream; engine gauges and cumulative counters are read from ``engine.get_stats()``
at scrape time by :class:`EngineStatsCollector`. Every series carries the labels
``model`` (served model name) and ``version`` (first 12 characters of the engine
fingerprint); a few add one bounded label (``finished_reason``, ``endpoint``,
``status_class``). Exact definitions: docs/METRICS.md.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from llmserve.contract.engine_client import EngineClient
from llmserve.protocol import RequestMetrics
from llmserve.server.metrics.admission import AdmissionMetrics, add_namespace_samples, namespace_families
from llmserve.server.metrics.vllm_names import VllmFamilies

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("model", "version")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                  0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 40.0, 60.0, 120.0, 240.0, 480.0)

#: URL path -> ``endpoint`` label; anything else is "other" (bounded cardinality).
ENDPOINT_LABELS = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/models": "models",
    "/health": "health",
    "/ready": "ready",
    "/metrics": "metrics",
}


def endpoint_label(path: str) -> str:
    """The bounded ``endpoint`` label of a URL path."""
    if path in ENDPOINT_LABELS:
        return ENDPOINT_LABELS[path]
    if path.startswith("/v1/models/"):
        return "models"
    return "other"


def short_version(fingerprint: str) -> str:
    """The ``version`` label: a short prefix of the engine fingerprint."""
    return (fingerprint or "unknown")[:12]


#: Engine series that read one ``EngineStats`` field each: (kind, name, field, help).
_STAT_SERIES = (
    ("gauge", "llmserve_model_weight_bytes", "weight_bytes",
     "Bytes of model weights resident (quantized formats at their packed size)"),
    ("counter", "llmserve_spec_proposed_tokens", "spec_proposed_tokens_total",
     "Speculative draft tokens the target model verified"),
    ("counter", "llmserve_spec_accepted_tokens", "spec_accepted_tokens_total",
     "Speculative draft tokens the target model accepted"),
    ("counter", "llmserve_grammar_mask_seconds", "grammar_mask_seconds_total",
     "Structured outputs: time spent bringing grammars up to date and computing the "
     "token bitmasks of constrained rows (per step, on the engine thread)"),
    ("counter", "llmserve_grammar_mask_steps", "grammar_mask_steps_total",
     "Engine steps that computed at least one grammar bitmask"),
    ("counter", "llmserve_grammar_mask_rows", "grammar_mask_rows_total",
     "Grammar bitmasks computed (one per constrained sequence per step)"),
    ("counter", "llmserve_grammar_compile_seconds", "grammar_compile_seconds_total",
     "Time compiling grammars (JSON schemas, regexes ...), off the engine thread"),
    ("counter", "llmserve_grammar_cache_hits", "grammar_cache_hits",
     "Structured-output requests whose grammar was already compiled"),
    ("counter", "llmserve_grammar_cache_misses", "grammar_cache_misses",
     "Structured-output requests whose grammar had to be compiled"),
    ("gauge", "llmserve_kv_cache_bytes_per_token", "kv_bytes_per_token",
     "KV-pool bytes per token slot: all layers, K and V, quantization scales included"),
)

_SPEC_HIST = "llmserve_spec_acceptance_length"
_SPEC_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)


def acceptance_buckets(lengths: list[int]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative Prometheus buckets and the sum from ``lengths[a]`` = verifications that
    accepted ``a`` drafts."""
    cumulative = list(itertools.accumulate(lengths)) or [0]
    out = [(str(float(bound)), float(cumulative[min(bound, len(cumulative) - 1)]))
           for bound in _SPEC_BUCKETS]
    out.append(("+Inf", float(cumulative[-1])))
    return out, float(sum(a * c for a, c in enumerate(lengths)))


class EngineStatsCollector(Collector):
    """Reads ``engine.get_stats()`` on every scrape and exposes gauges and counters;
    one series per engine (see :meth:`add`), told apart by the ``model`` label."""

    def __init__(self, engine: EngineClient, label_values: tuple[str, str],
                 per_namespace: bool = False) -> None:
        """``per_namespace``: also the prefix-cache counters per cache namespace (their
        labels name tenants, so only when the gateway opts in: ``metrics.per_tenant``)."""
        self._engines: list[tuple[Any, list[str]]] = [(engine, list(label_values))]
        self.per_namespace = per_namespace

    def add(self, engine: EngineClient, label_values: tuple[str, str]) -> None:
        """Export another engine's stats too (e.g. a fallback model's)."""
        self._engines.append((engine, list(label_values)))

    def collect(self) -> Iterator[Any]:
        families: dict[str, Any] = {}
        ns_queries, ns_hits = namespace_families(LABELS)
        vllm = VllmFamilies()   # the same snapshots under vLLM's names (vllm_names.py)
        for engine, lv in self._engines:
            try:
                stats = engine.get_stats()
            except Exception:  # noqa: BLE001 - a broken engine must not break /metrics
                logger.exception("engine.get_stats() failed during a metrics scrape")
                continue
            if self.per_namespace:
                add_namespace_samples(ns_queries, ns_hits, stats, lv)
            vllm.add(stats, lv[0])
            for kind, name, doc, value in self._samples(stats):
                family = families.get(name)
                if family is None:
                    cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                    family = families[name] = cls(name, doc, labels=LABELS)
                family.add_metric(lv, value)
            lengths = getattr(stats, "spec_acceptance_lengths", None)
            if lengths is not None:
                family = families.get(_SPEC_HIST)
                if family is None:
                    family = families[_SPEC_HIST] = HistogramMetricFamily(
                        _SPEC_HIST, "Draft tokens accepted per speculative verification "
                        "(one observation per sequence and step that drafted)", labels=LABELS)
                buckets, total = acceptance_buckets(lengths)
                family.add_metric(lv, buckets, total)
        yield from families.values()
        yield from vllm
        if self.per_namespace:
            yield ns_queries
            yield ns_hits

    @staticmethod
    def _samples(s: Any) -> Iterator[tuple[str, str, str, float]]:
        """(kind, name, help, value) of every engine metric for one stats snapshot."""
        total = s.kv_blocks_total
        yield ("gauge", "llmserve_num_requests_running",
                      "Requests in the engine's running batch", s.num_running)
        yield ("gauge", "llmserve_num_requests_waiting",
                      "Requests queued in the engine, not yet running", s.num_waiting)
        yield ("gauge", "llmserve_kv_cache_blocks_used", "KV-cache blocks in use",
                      s.kv_blocks_used)
        yield ("gauge", "llmserve_kv_cache_blocks_total", "KV-cache blocks in the pool", total)
        yield ("gauge", "llmserve_kv_cache_blocks_high_water",
                      "Most KV-cache blocks ever in use at once", s.kv_blocks_high_water)
        yield ("gauge", "llmserve_kv_cache_usage_ratio",
                      "kv_cache_blocks_used / kv_cache_blocks_total (0 when no pool)",
                      (s.kv_blocks_used / total) if total else 0.0)
        yield ("counter", "llmserve_prompt_tokens", "Prompt tokens the engine has processed",
                      s.prompt_tokens_total)
        yield ("counter", "llmserve_generation_tokens", "Tokens the engine has generated",
                      s.generation_tokens_total)
        yield ("counter", "llmserve_prefix_cache_queries",
                      "Prompt tokens looked up in the prefix cache", s.prefix_query_tokens)
        yield ("counter", "llmserve_prefix_cache_hits",
                      "Prompt tokens found in the prefix cache", s.prefix_hit_tokens)
        yield ("counter", "llmserve_num_preemptions", "Sequences preempted by the scheduler",
                      s.num_preemptions)
        yield ("counter", "llmserve_request_aborted", "Requests aborted in the engine",
                      s.num_aborted)
        yield ("counter", "llmserve_engine_steps", "Engine scheduler steps", s.num_steps)
        yield ("counter", "llmserve_step_errors",
               "Engine steps whose model execution raised (the failing requests were "
               "isolated and failed alone)", s.num_step_errors)
        yield ("counter", "llmserve_step_reruns",
               "Extra runs of failed steps' other requests while isolating the failing ones "
               "(one per failed step when the error names its requests, e.g. NaN logits)",
               s.num_step_reruns)
        for kind, name, field, doc in _STAT_SERIES:
            yield (kind, name, doc, getattr(s, field, 0))


class ServerMetrics:
    """All metrics of one app, in a private CollectorRegistry."""

    def __init__(self, engine: EngineClient, model_name: str, fingerprint: str,
                 per_tenant: bool = False) -> None:
        self.registry = CollectorRegistry()
        lv = (model_name, short_version(fingerprint))
        self.label_values = lv
        reg = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg).labels(*lv)

        self.ttft = hist("llmserve_time_to_first_token_seconds",
                         "From request arrival at the server to the first generated token",
                         _TTFT_BUCKETS)
        self.itl = hist("llmserve_inter_token_latency_seconds",
                        "Gap between consecutive tokens of one choice, as received from the engine",
                        _TOKEN_BUCKETS)
        self.tpot = hist("llmserve_time_per_output_token_seconds",
                         "Per finished choice: (last token - first token) / (tokens - 1)",
                         _TOKEN_BUCKETS)
        self.e2e = hist("llmserve_e2e_request_latency_seconds",
                        "From request arrival at the server to the end of the response",
                        _REQUEST_BUCKETS)
        self.queue_time = hist("llmserve_queue_time_seconds",
                               "Engine: first scheduled - arrival", _REQUEST_BUCKETS)
        self.prefill_time = hist("llmserve_prefill_time_seconds",
                                 "Engine: first token - first scheduled", _REQUEST_BUCKETS)
        self.decode_time = hist("llmserve_decode_time_seconds",
                                "Engine: last token - first token", _REQUEST_BUCKETS)
        self._success = Counter("llmserve_request_success",
                                "Choices that finished, by engine finish reason",
                                LABELS + ("finished_reason",), registry=reg)
        self._http = Counter("llmserve_http_requests", "HTTP responses by endpoint and status class",
                             LABELS + ("endpoint", "status_class"), registry=reg)
        self.client_disconnects = Counter(
            "llmserve_client_disconnects",
            "Generation requests whose client went away before the response ended",
            LABELS, registry=reg).labels(*lv)
        self.embedding_inputs = Counter(
            "llmserve_embedding_inputs",
            "Inputs embedded by /v1/embeddings (one vector each)",
            LABELS, registry=reg).labels(*lv)
        self.in_progress = Gauge("llmserve_generation_requests_in_progress",
                                 "Generation requests being served by the HTTP server",
                                 LABELS, registry=reg).labels(*lv)
        self._engine_stats = EngineStatsCollector(engine, lv, per_namespace=per_tenant)
        reg.register(self._engine_stats)
        extra = getattr(engine, "metrics_collector", None)  # e.g. a router's per-replica series
        if callable(extra):
            reg.register(extra())
        # rejections and cancel-to-KV-freed latency (the per-namespace prefix-cache
        # counters come with the engine series: one stats snapshot per engine and scrape)
        self.admission = AdmissionMetrics(self.registry, LABELS, self.label_values)

    def add_engine(self, engine: EngineClient, model_name: str, fingerprint: str) -> None:
        """Export the engine gauges and counters of another served engine as well."""
        self._engine_stats.add(engine, (model_name, short_version(fingerprint)))

    def count_success(self, finished_reason: str) -> None:
        self._success.labels(*self.label_values, str(finished_reason)).inc()

    def count_http(self, path: str, status: int) -> None:
        self._http.labels(*self.label_values, endpoint_label(path), f"{status // 100}xx").inc()

    def observe_engine_metrics(self, m: Optional[RequestMetrics]) -> None:
        """Queue / prefill / decode times from the engine's timestamps (where known)."""
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            if m.first_token_time is not None:
                self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.first_token_time is not None and m.last_token_time is not None:
            self.decode_time.observe(max(0.0, m.last_token_time - m.first_token_time))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestTimer:
    """Observes TTFT, ITL and TPOT for one HTTP request as its tokens arrive.

    Choices are keyed by their response index. Times are ``time.monotonic()``.
    """

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self._m = metrics
        self.arrival = arrival
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._ttft_done = False

    def on_tokens(self, choice: int, k: int, now: Optional[float] = None) -> None:
        """``k`` new tokens of ``choice`` arrived together at ``now``.

        The first token of the request observes TTFT. Within a choice, an increment
        observes one ITL sample (the gap since the previous increment) for its first
        token and a 0 for each further token that arrived with it, so the samples of a
        choice number ``tokens - 1`` and sum to its last-minus-first token time.
        """
        if k <= 0:
            return
        now = time.monotonic() if now is None else now
        if not self._ttft_done:
            self._ttft_done = True
            self._m.ttft.observe(max(0.0, now - self.arrival))
        prev = self._last.get(choice)
        if prev is None:
            self._first[choice] = now
        else:
            self._m.itl.observe(max(0.0, now - prev))
        for _ in range(k - 1):
            self._m.itl.observe(0.0)
        self._last[choice] = now

    def on_choice_finished(self, choice: int, num_tokens: int, reason: str) -> None:
        """A choice ended: count it and observe its TPOT (when it has 2+ tokens)."""
        self._m.count_success(reason)
        first, last = self._first.get(choice), self._last.get(choice)
        if num_tokens >= 2 and first is not None and last is not None:
            self._m.tpot.observe(max(0.0, last - first) / (num_tokens - 1))

    def on_request_done(self, now: Optional[float] = None) -> None:
        """The response is complete: observe end-to-end latency."""
        now = time.monotonic() if now is None else now
        self._m.e2e.observe(max(0.0, now - self.arrival))
