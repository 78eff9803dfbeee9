"""Metric arithmetic against hand-computed timelines."""
from __future__ import annotations

import math

import pytest

from llmserve.bench.metrics import (
    RequestRecord,
    bucket_of,
    compute_metrics,
    concurrency_throughput_series,
    meets_slo,
    parse_slo,
    percentile,
    summarize,
)


def ok(rid, input_len, arrivals, end, usage=None, send=0.0) -> RequestRecord:
    return RequestRecord(rid, input_len, send_time=send, arrival_times=list(arrivals),
                         end_time=end, success=True, usage_completion_tokens=usage)


def failed(rid, input_len, error, end=0.5, send=0.0) -> RequestRecord:
    return RequestRecord(rid, input_len, send_time=send, end_time=end, success=False, error=error)


def test_percentile_linear_interpolation():
    xs = [40.0, 10.0, 30.0, 20.0]             # sorted: 10 20 30 40
    assert percentile(xs, 0) == 10.0
    assert percentile(xs, 100) == 40.0
    assert percentile(xs, 50) == pytest.approx(25.0)        # rank 1.5
    assert percentile(xs, 90) == pytest.approx(37.0)        # rank 2.7 -> 30 + 0.7 * 10
    assert percentile(xs, 99) == pytest.approx(39.7)        # rank 2.97
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_scales_and_handles_empty():
    s = summarize([0.001, 0.003], scale=1000.0)
    assert s["count"] == 2 and s["mean"] == pytest.approx(2.0)
    assert s["p50"] == pytest.approx(2.0) and s["max"] == pytest.approx(3.0)
    assert s["min"] == pytest.approx(1.0)
    empty = summarize([])
    assert empty["count"] == 0 and empty["p99"] is None and empty["mean"] is None


def test_multi_token_chunks_single_request():
    # 5 tokens in 3 content events at 0.1, 0.3 (2 tokens), 0.6 (2 tokens); stream ends 0.7
    r = ok("a", 10, [0.1, 0.3, 0.6], 0.7, usage=5)
    assert r.output_tokens == 5
    assert r.ttft == pytest.approx(0.1)
    assert r.itls == pytest.approx([0.2, 0.3])            # one gap per event, not per token
    assert r.tpot == pytest.approx((0.7 - 0.1) / 4)        # tokens from usage
    # without usage each event counts as one token
    r2 = ok("b", 10, [0.1, 0.3, 0.6], 0.7)
    assert r2.output_tokens == 3
    assert r2.tpot == pytest.approx((0.7 - 0.1) / 2)


def test_single_token_request_has_no_tpot_or_itl():
    r = ok("a", 4, [0.2], 0.25, usage=1)
    assert r.tpot is None and r.itls == [] and r.ttft == pytest.approx(0.2)


def test_compute_metrics_excludes_failures_from_latency_but_counts_errors():
    records = [
        ok("a", 100, [0.1, 0.2, 0.4], 0.5, usage=4),        # tpot (0.5-0.1)/3
        ok("b", 300, [0.3, 0.5], 0.6, usage=2),             # tpot 0.3
        failed("c", 100, "503"),
        failed("d", 3000, "503"),
        failed("e", 100, "timeout"),
    ]
    m = compute_metrics(records, duration_s=2.0, bucket_edges=(0, 256, 1024))
    assert (m["num_requests"], m["completed"], m["failed"]) == (5, 2, 3)
    assert m["errors"] == {"503": 2, "timeout": 1}
    assert m["ttft_ms"]["count"] == 2
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["ttft_ms"]["max"] == pytest.approx(300.0)
    assert m["itl_ms"]["count"] == 3                            # 0.1, 0.2 and 0.2
    assert m["itl_ms"]["mean"] == pytest.approx(1000 * 0.5 / 3)
    assert m["tpot_ms"]["mean"] == pytest.approx(1000 * ((0.4 / 3) + 0.3) / 2)
    assert m["e2e_ms"]["p50"] == pytest.approx(550.0)
    assert m["total_input_tokens"] == 400 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_token_throughput"] == pytest.approx(3.0)
    assert m["input_token_throughput"] == pytest.approx(200.0)
    assert m["total_token_throughput"] == pytest.approx(203.0)
    # in-flight time: 0.5 + 0.6 + 3 x 0.5 = 2.6 s over 2 s
    assert m["mean_in_flight"] == pytest.approx(1.3)
    buckets = {b["bucket"]: b for b in m["by_input_len"]}
    assert set(buckets) == {"[0, 256)", "[256, 1024)", "[1024, inf)"}
    assert buckets["[0, 256)"]["num_requests"] == 3
    assert buckets["[0, 256)"]["completed"] == 1
    assert buckets["[0, 256)"]["errors"] == {"503": 1, "timeout": 1}
    assert buckets["[256, 1024)"]["ttft_ms"]["p50"] == pytest.approx(300.0)
    assert buckets["[256, 1024)"]["total_output_tokens"] == 2
    assert buckets["[0, 256)"]["total_input_tokens"] == 100
    assert buckets["[0, 256)"]["good_requests"] == 1             # no SLO: every success
    assert buckets["[1024, inf)"]["ttft_ms"]["count"] == 0
    assert buckets["[1024, inf)"]["hi"] is None


def test_prompt_tokens_prefer_usage():
    r = ok("a", 100, [0.1], 0.2, usage=1)
    r.usage_prompt_tokens = 101
    m = compute_metrics([r], 1.0)
    assert m["total_input_tokens"] == 101


def test_goodput_and_slo_parsing():
    slo = parse_slo("ttft_ms=250, tpot_ms=150")
    assert slo == {"ttft_ms": 250.0, "tpot_ms": 150.0}
    fast = ok("a", 10, [0.1, 0.2, 0.3], 0.3, usage=3)       # ttft 100, tpot 100
    slow_first = ok("b", 10, [0.3, 0.35], 0.4, usage=2)      # ttft 300 > 250
    slow_decode = ok("c", 10, [0.1, 0.5], 0.5, usage=2)      # tpot 400 > 150
    one_token = ok("d", 10, [0.2], 0.2, usage=1)             # tpot undefined: passes
    bad = failed("e", 10, "500")
    assert meets_slo(fast, slo) and meets_slo(one_token, slo)
    assert not meets_slo(slow_first, slo) and not meets_slo(slow_decode, slo)
    assert not meets_slo(bad, slo)
    m = compute_metrics([fast, slow_first, slow_decode, one_token, bad], 4.0, slo)
    assert m["good_requests"] == 2
    assert m["goodput"] == pytest.approx(0.5)
    assert m["goodput_fraction"] == pytest.approx(0.4)
    assert parse_slo(None) == {} and parse_slo("") == {}
    for bad_text in ("ttft=5", "ttft_ms", "ttft_ms=abc", "tpot_ms=-1"):
        with pytest.raises(ValueError):
            parse_slo(bad_text)


def test_bucket_edges():
    assert bucket_of(0, (0, 64, 128)) == (0, 64)
    assert bucket_of(64, (0, 64, 128)) == (64, 128)
    assert bucket_of(5000, (0, 64, 128)) == (128, math.inf)
    with pytest.raises(ValueError):
        bucket_of(5, (64, 0))


def test_compute_metrics_rejects_zero_duration():
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


def test_record_to_dict_round_numbers():
    d = ok("a", 10, [0.1, 0.3], 0.4, usage=3).to_dict()
    assert d["ttft"] == pytest.approx(0.1) and d["itl"] == [pytest.approx(0.2)]
    assert d["output_tokens"] == 3 and d["usage_reported"] is True and d["success"] is True


def test_concurrency_throughput_series():
    # two requests over [0, 1]: A in flight 0..1 (2 tokens at 0.25, 0.75), B 0..0.5 (1 token
    # at 0.5, counted in the window it falls in)
    a = ok("a", 1, [0.25, 0.75], 1.0, usage=2, send=0.0)
    b = ok("b", 1, [0.4], 0.5, usage=1, send=0.0)
    series = concurrency_throughput_series([a, b], num_windows=2)
    assert series[0][0] == pytest.approx(2.0) and series[1][0] == pytest.approx(1.0)
    assert series[0][1] == pytest.approx(4.0)     # 2 tokens in 0.5 s
    assert series[1][1] == pytest.approx(2.0)
    assert concurrency_throughput_series([]) == []


def test_server_counters_parse_sum_labels_and_delta():
    from llmserve.bench.server_counters import counter_delta, describe, parse_counters

    text = "\n".join([
        "# HELP llmserve_spec_proposed_tokens_total x",
        'llmserve_spec_proposed_tokens_total{model="a"} 10.0',
        'llmserve_spec_proposed_tokens_total{model="b"} 30.0',
        'llmserve_spec_accepted_tokens_total{model="a"} 12.0',
        "llmserve_prefix_cache_queries_total 100",
        "llmserve_prefix_cache_hits_total 25",
        "unrelated_total 5"])
    after = parse_counters(text)
    assert after == {"spec_proposed_tokens": 40.0, "spec_accepted_tokens": 12.0,
                     "prefix_cache_queries": 100.0, "prefix_cache_hits": 25.0}
    delta = counter_delta({"spec_proposed_tokens": 20.0, "spec_accepted_tokens": 2.0}, after)
    assert delta["spec_proposed_tokens"] == 20.0 and delta["spec_acceptance_rate"] == 0.5
    rows = dict(describe(delta))
    assert rows["Speculative tokens accepted / proposed (server)"] == "10 / 20 (50.0%)"
    assert rows["Prefix-cache hit rate (server)"] == "25.0%"
    assert counter_delta(None, after) is None and describe(None) == []
