"""/metrics: valid exposition, bounded labels, and values that follow the traffic."""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmserve.server.metrics.prometheus import RequestTimer, ServerMetrics, short_version
from tests.server.conftest import LiveServer
from tests.server.server_fakes import FakeEngine
from tests.server.server_helpers import chat_body, metric_value, parse_sse

HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
              "time_per_output_token_seconds", "e2e_request_latency_seconds",
              "queue_time_seconds", "prefill_time_seconds", "decode_time_seconds"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_blocks_used",
          "kv_cache_blocks_total", "kv_cache_usage_ratio"]
COUNTERS = ["prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
            "num_preemptions", "request_aborted", "request_success", "http_requests",
            "client_disconnects"]
ALLOWED_LABELS = {"model", "version", "le", "finished_reason", "endpoint", "status_class", "reason",
                  "cache_namespace"}


def scrape(server: LiveServer) -> str:
    r = httpx.get(server.url("/metrics"), timeout=5)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return r.text


def test_exposition_parses_with_expected_families_and_labels(server: LiveServer) -> None:
    httpx.post(server.url("/v1/chat/completions"), json=chat_body(max_tokens=3), timeout=60)
    families = {f.name: f for f in text_string_to_metric_families(scrape(server))}
    for name in HISTOGRAMS:
        assert families[f"llmserve_{name}"].type == "histogram", name
    for name in GAUGES:
        assert families[f"llmserve_{name}"].type == "gauge", name
    for name in COUNTERS:
        assert families[f"llmserve_{name}"].type == "counter", name
    version = short_version(server.engine.fingerprint)
    for family in families.values():
        if not family.name.startswith("llmserve_"):
            continue
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, sample
            assert sample.labels["model"] == server.engine.model_name
            assert sample.labels["version"] == version


def test_metrics_follow_a_request(server: LiveServer) -> None:
    before = scrape(server)
    max_tokens = 6
    r = httpx.post(server.url("/v1/chat/completions"), timeout=60, json=chat_body(
        max_tokens=max_tokens, ignore_eos=True, n=2, temperature=0, stream=True))
    assert r.status_code == 200 and parse_sse(r.text)[-1] == "[DONE]"
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("llmserve_time_to_first_token_seconds_count") == 1
    assert delta("llmserve_e2e_request_latency_seconds_count") == 1
    # ITL: tokens - 1 samples per choice; TPOT: one sample per choice
    assert delta("llmserve_inter_token_latency_seconds_count") == 2 * (max_tokens - 1)
    assert delta("llmserve_time_per_output_token_seconds_count") == 2
    assert delta("llmserve_request_success_total", finished_reason="length") == 2
    assert delta("llmserve_queue_time_seconds_count") >= 1
    assert delta("llmserve_decode_time_seconds_count") >= 1
    assert delta("llmserve_generation_tokens_total") >= 2 * max_tokens
    assert delta("llmserve_prompt_tokens_total") >= 1
    assert delta("llmserve_http_requests_total", endpoint="chat_completions",
                 status_class="2xx") == 1


def test_engine_gauges_match_engine_stats(server: LiveServer) -> None:
    text = scrape(server)
    stats = server.engine.get_stats()
    assert metric_value(text, "llmserve_kv_cache_blocks_total") == stats.kv_blocks_total
    assert metric_value(text, "llmserve_kv_cache_blocks_used") == stats.kv_blocks_used
    ratio = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
    assert abs(metric_value(text, "llmserve_kv_cache_usage_ratio") - ratio) < 1e-9
    assert metric_value(text, "llmserve_prefix_cache_hits_total") <= \
        metric_value(text, "llmserve_prefix_cache_queries_total")


def test_repeated_prompt_reports_cached_tokens(server: LiveServer) -> None:
    body = {"prompt": "A fairly long shared prefix for caching purposes. " * 4, "max_tokens": 2,
            "temperature": 0}
    httpx.post(server.url("/v1/completions"), json=body, timeout=60)
    hits0 = metric_value(scrape(server), "llmserve_prefix_cache_hits_total")
    second = httpx.post(server.url("/v1/completions"), json=body, timeout=60).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= second["usage"]["prompt_tokens"]
    assert metric_value(scrape(server), "llmserve_prefix_cache_hits_total") >= hits0 + cached


def test_itl_semantics_gap_then_zeros() -> None:
    """A k-token increment is one gap for its first token and 0 for the others."""
    m = ServerMetrics(FakeEngine(), "m", "fingerprint")
    timer = RequestTimer(m, arrival=100.0)
    timer.on_tokens(0, 1, now=100.25)      # first token: TTFT 0.25, no ITL
    timer.on_tokens(0, 3, now=100.75)      # gap 0.5, then two zeros
    timer.on_tokens(0, 0, now=101.0)       # a text-less increment counts nothing
    timer.on_tokens(0, 1, now=101.0)       # gap 0.25
    timer.on_choice_finished(0, 5, "stop")
    timer.on_request_done(now=101.5)
    text = m.render().decode()
    assert metric_value(text, "llmserve_time_to_first_token_seconds_sum") == 0.25
    assert metric_value(text, "llmserve_inter_token_latency_seconds_count") == 4
    assert metric_value(text, "llmserve_inter_token_latency_seconds_sum") == 0.75
    assert metric_value(text, "llmserve_inter_token_latency_seconds_bucket", le="0.001") == 2
    assert metric_value(text, "llmserve_time_per_output_token_seconds_sum") == 0.75 / 4
    assert metric_value(text, "llmserve_e2e_request_latency_seconds_sum") == 1.5
    assert metric_value(text, "llmserve_request_success_total", finished_reason="stop") == 1


def test_registries_are_private_per_app() -> None:
    a, b = ServerMetrics(FakeEngine(), "a", "x"), ServerMetrics(FakeEngine(), "b", "y")
    a.count_success("stop")
    assert metric_value(b.render().decode(), "llmserve_request_success_total") == 0
    assert metric_value(a.render().decode(), "llmserve_request_success_total") == 1


def test_speculative_decoding_metrics_render_from_engine_stats() -> None:
    from llmserve.protocol import EngineStats

    engine = FakeEngine()
    engine.get_stats = lambda: EngineStats(  # type: ignore[method-assign]
        spec_proposed_tokens_total=40, spec_accepted_tokens_total=23,
        spec_acceptance_lengths=[3, 2, 0, 1, 4])
    text = ServerMetrics(engine, "m", "fp").render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["llmserve_spec_proposed_tokens"].type == "counter"
    assert metric_value(text, "llmserve_spec_proposed_tokens_total") == 40
    assert metric_value(text, "llmserve_spec_accepted_tokens_total") == 23
    hist = families["llmserve_spec_acceptance_length"]
    assert hist.type == "histogram"
    assert metric_value(text, "llmserve_spec_acceptance_length_count") == 10
    assert metric_value(text, "llmserve_spec_acceptance_length_sum") == 2 + 3 + 16
    assert metric_value(text, "llmserve_spec_acceptance_length_bucket", le="1.0") == 5
    assert metric_value(text, "llmserve_spec_acceptance_length_bucket", le="+Inf") == 10
