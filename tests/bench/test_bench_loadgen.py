"""The streaming client against a real HTTP server on 127.0.0.1 (the fake in bench_fake_server)."""
from __future__ import annotations

import asyncio
import math
import statistics

import pytest

from llmserve.bench.loadgen import SSEParser, build_payload, poisson_arrival_offsets, run_load
from llmserve.bench.workloads import RequestSpec


def spec(i: int, prompt: str = "a b c", out: int = 5, conv=None, turn=None) -> RequestSpec:
    return RequestSpec(f"r{i}", prompt, [{"role": "user", "content": prompt}], 3, out,
                       conversation_id=conv, turn=turn)


def test_sse_parser_handles_split_and_batched_events():
    p = SSEParser()
    assert p.feed(b'data: {"a"') == []
    assert p.feed(b': 1}\r') == []
    assert p.feed(b'\n\r\ndata: two\n\ndata: three\n') == ['{"a": 1}', "two"]
    assert p.feed(b"\n: a comment\n\nevent: x\ndata: l1\ndata:l2\n\n") == ["three", "l1\nl2"]
    assert p.feed(b"data: [DO") == []
    assert p.flush() == ["[DO"]
    p2 = SSEParser()
    euro = "data: \u20ac\n\n".encode()
    assert p2.feed(euro[:7]) == [] and p2.feed(euro[7:]) == ["\u20ac"]  # UTF-8 split mid-char


def test_build_payload_asks_for_exact_lengths():
    s = spec(0, out=9)
    body = build_payload(s, "m", "completions", extra_body={"top_p": 0.5})
    assert body["prompt"] == "a b c" and body["max_tokens"] == 9 and body["min_tokens"] == 9
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["top_p"] == 0.5
    chat = build_payload(s, "m", "chat", ignore_eos=False)
    assert chat["messages"] == s.messages and "prompt" not in chat
    assert "ignore_eos" not in chat and "min_tokens" not in chat
    with pytest.raises(ValueError):
        build_payload(s, "m", "embeddings")


def test_poisson_offsets_are_seeded_with_the_right_rate():
    a = poisson_arrival_offsets(2000, 10.0, seed=1)
    assert a == poisson_arrival_offsets(2000, 10.0, seed=1)
    assert a != poisson_arrival_offsets(2000, 10.0, seed=2)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.1)
    assert poisson_arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrival_offsets(3, 0.0)


@pytest.mark.parametrize("usage", [True, False])
def test_stream_counts_tokens_and_chunks(fake_server, usage):
    # the fake sends 7 tokens as events of 1,1,2,1,1,(1): every third event carries two
    with fake_server(usage=usage) as srv:
        result = asyncio.run(run_load(srv.url, [spec(0, out=7)], progress=False))
    r = result.records[0]
    assert r.success and r.error is None and result.model == "fake-model"
    assert len(r.arrival_times) == 6
    assert r.output_tokens == (7 if usage else 6)
    assert r.usage_prompt_tokens == (3 if usage else None)
    assert len(r.itls) == 5 and all(g >= 0 for g in r.itls)
    assert sum(r.itls) == pytest.approx(r.arrival_times[-1] - r.arrival_times[0])
    assert 0 < r.ttft < r.e2e
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / (r.output_tokens - 1))


def test_chat_endpoint_ignores_role_only_event(fake_server):
    with fake_server() as srv:
        result = asyncio.run(run_load(srv.url, [spec(0, out=4)], endpoint="chat",
                                      progress=False))
        body = srv.server.config.app.state.bench["bodies"][0]
    r = result.records[0]
    assert r.success and r.output_tokens == 4 and len(r.arrival_times) == 3
    assert body["messages"] == [{"role": "user", "content": "a b c"}]
    assert body["ignore_eos"] is True and body["min_tokens"] == 4


def test_errors_are_counted_by_kind(fake_server):
    specs = [spec(0), spec(1), spec(2, prompt="please BREAK here", out=6)]
    with fake_server(fail_requests=frozenset({2})) as srv:
        result = asyncio.run(run_load(srv.url, specs, max_concurrency=1, progress=False))
    errors = {r.request_id: r.error for r in result.records}
    assert errors == {"r0": None, "r1": "503", "r2": "connection"}
    assert result.records[1].ttft is None and result.records[2].itls == []
    assert "overloaded" in result.records[1].error_detail


def test_unreachable_server_is_a_connection_error():
    from tests.bench.bench_fake_server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    result = asyncio.run(run_load(url, [spec(0)], model="m", progress=False,
                                  request_timeout_s=5))
    assert result.records[0].error == "connection" and not result.records[0].success


def test_timeout_is_reported(fake_server):
    with fake_server(token_delay_s=0.3) as srv:
        result = asyncio.run(run_load(srv.url, [spec(0, out=20)], progress=False,
                                      request_timeout_s=0.5))
    assert result.records[0].error == "timeout"


def test_concurrency_limit_and_chat_turn_order(fake_server):
    specs = [spec(0, conv=0, turn=0), spec(1, conv=1, turn=0), spec(2, conv=0, turn=1),
             spec(3, conv=1, turn=1)]
    with fake_server(token_delay_s=0.01) as srv:
        result = asyncio.run(run_load(srv.url, specs, max_concurrency=2, progress=False))
    recs = {r.request_id: r for r in result.records}
    assert all(r.success for r in recs.values())
    for first, second in (("r0", "r2"), ("r1", "r3")):
        assert recs[second].send_time >= recs[first].send_time + recs[first].end_time - 1e-6
    spans = sorted((r.send_time, r.send_time + r.end_time) for r in recs.values())
    for t, _ in spans:   # at most 2 in flight at any send instant
        assert sum(1 for s, e in spans if s <= t < e) <= 2


def _sse_stream_after_failures(failures: int):
    """An httpx mock handler whose first ``failures`` POSTs die like a stale keep-alive
    connection, and which then streams two tokens with usage."""
    import httpx

    calls = {"n": 0}
    body = (b'data: {"choices": [{"text": "a"}]}\n\n'
            b'data: {"choices": [{"text": "b", "finish_reason": "length"}], '
            b'"usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\ndata: [DONE]\n\n')

    def handler(request):
        calls["n"] += 1
        if calls["n"] <= failures:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return handler, calls


@pytest.mark.parametrize("failures,ok", [(0, True), (1, True), (2, False)])
def test_stream_one_resends_once_after_a_stale_connection(failures, ok):
    import httpx

    from llmserve.bench.loadgen import RequestRecord, stream_one

    handler, calls = _sse_stream_after_failures(failures)

    async def go() -> RequestRecord:
        record = RequestRecord("r0", 3, expected_output_len=2)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await stream_one(client, "http://x/v1/completions", {"prompt": "p"}, record)
        return record

    record = asyncio.run(go())
    assert record.success is ok and calls["n"] == min(failures + 1, 2)
    if ok:
        assert record.usage_completion_tokens == 2 and len(record.arrival_times) == 2
    else:
        assert record.error == "connection"


def test_multi_turn_sends_the_servers_real_answer_back(fake_server, tmp_path):
    from llmserve.bench.metrics import RequestRecord, turn_reuse
    from llmserve.bench.workloads import WhitespaceTokenizer, build_workload

    specs = build_workload("multi-turn", WhitespaceTokenizer(), num_prompts=4, input_len=5,
                           output_len=3, num_turns=2)
    assert [(s.conversation_id, s.turn, s.meta["follow_up"]) for s in specs] == \
        [(0, 0, False), (1, 0, False), (0, 1, True), (1, 1, True)]
    with fake_server() as srv:
        result = asyncio.run(run_load(srv.url, specs, endpoint="chat", progress=False))
        bodies = srv.server.config.app.state.bench["bodies"]
    assert all(r.success for r in result.records)
    assert not any("follow_up" in b for b in bodies)   # workload facts are never sent
    first = next(r for r in result.records if (r.conversation_id, r.turn) == (0, 0))
    follow = next(b for b in bodies if len(b["messages"]) == 4
                  and b["messages"][0]["content"] == "Conversation 0.")
    assert follow["messages"][2] == {"role": "assistant", "content": "".join(first.reply_text)}
    assert follow["messages"][3] == specs[2].messages[0]
    recs = [RequestRecord("a", 10, success=True, end_time=1.0, usage_prompt_tokens=10,
                          usage_completion_tokens=6, conversation_id=0, turn=0),
            RequestRecord("b", 5, success=True, end_time=1.0, usage_prompt_tokens=20,
                          usage_completion_tokens=2, usage_cached_tokens=16,
                          conversation_id=0, turn=1)]
    assert turn_reuse(recs) == [{"turn": 1, "conversations": 1, "cached_tokens": 16,
                                 "previous_context_tokens": 16, "coverage": 1.0}]
