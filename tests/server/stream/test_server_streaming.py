"""SSE framing, chunk order, request ids and client-disconnect aborts (any engine)."""
from __future__ import annotations

import json
import socket
import time

import httpx

from tests.server.conftest import LiveServer
from tests.server.server_helpers import chat_body, metric_value, parse_sse, wait_idle, wait_until


def long_generation(server: LiveServer) -> int:
    """max_tokens for a request that cannot finish within the test's patience."""
    return min(2000, server.engine.max_model_len - 64)


def test_sse_framing_and_chat_chunk_order(server: LiveServer) -> None:
    r = httpx.post(server.url("/v1/chat/completions"), timeout=60,
                   json=chat_body(max_tokens=10, temperature=0, n=2, stream=True))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"]
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    seen_role, finished = set(), set()
    texts = {0: "", 1: ""}
    for ch in chunks:
        assert ch["object"] == "chat.completion.chunk" and "usage" not in ch
        (choice,) = ch["choices"]
        i = choice["index"]
        assert i not in finished, "chunk after the choice's finish chunk"
        if "role" in choice["delta"]:
            assert i not in seen_role and choice["delta"] == {"role": "assistant", "content": ""}
            seen_role.add(i)
            continue
        assert i in seen_role, "content before the role chunk"
        if choice["finish_reason"] is not None:
            assert choice["delta"] == {}
            finished.add(i)
        else:
            texts[i] += choice["delta"]["content"]
    assert seen_role == finished == {0, 1}
    assert texts[0] == texts[1]  # greedy


def test_completion_stream_include_usage_matches_sum(server: LiveServer) -> None:
    body = {"prompt": ["Alpha", "Beta gamma"], "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
    events = parse_sse(r.text)
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and events[-1] == "[DONE]"
    assert all(e["usage"] is None for e in events[:-2])
    nonstream = httpx.post(server.url("/v1/completions"), timeout=60,
                           json={**body, "stream": False, "stream_options": None}).json()
    streamed, plain = usage_chunk["usage"], nonstream["usage"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert streamed[key] == plain[key], key
    assert streamed["total_tokens"] == streamed["prompt_tokens"] + streamed["completion_tokens"]
    # the repeat may hit the prefix cache, never the other way round
    assert plain["prompt_tokens_details"]["cached_tokens"] >= \
        streamed["prompt_tokens_details"]["cached_tokens"]


def test_duplicate_request_ids_in_flight_are_both_served(server: LiveServer) -> None:
    headers = {"X-Request-Id": "same-id"}
    long_body = chat_body(max_tokens=long_generation(server), ignore_eos=True, stream=True)
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url("/v1/chat/completions"), json=long_body,
                      headers=headers) as first:
            lines = first.iter_lines()  # keep a reference: a closed iterator drops the connection
            first_line = next(line for line in lines if line.startswith("data: "))
            first_id = json.loads(first_line[len("data: "):])["id"]
            # the first request is still generating: the same id must not collide in the engine
            second = httpx.post(server.url("/v1/chat/completions"), timeout=60, headers=headers,
                                json=chat_body(max_tokens=3, stream=True))
    assert first.status_code == second.status_code == 200
    assert first.headers["x-request-id"] == second.headers["x-request-id"] == "same-id"
    second_id = parse_sse(second.text)[0]["id"]
    assert first_id == "chatcmpl-same-id"
    assert second_id != first_id and second_id.startswith("chatcmpl-same-id-")


def test_bad_request_id_header_is_replaced(server: LiveServer) -> None:
    r = httpx.get(server.url("/health"), headers={"X-Request-Id": "bad id with spaces"})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert rid != "bad id with spaces" and rid.isalnum()


def test_streaming_disconnect_aborts_engine_request(server: LiveServer) -> None:
    eng = server.engine
    wait_idle(eng)
    baseline = eng.get_stats().kv_blocks_used
    before = server.metrics_text()
    aborted0 = metric_value(before, "llmserve_request_aborted_total")
    gone0 = metric_value(before, "llmserve_client_disconnects_total")
    body = chat_body(max_tokens=long_generation(server), ignore_eos=True, stream=True)
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url("/v1/chat/completions"), json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 2:
                        break
            # stats are a per-step snapshot: allow the engine a moment to publish them
            assert wait_until(lambda: eng.get_stats().kv_blocks_used > baseline, 5.0)
    # leaving the blocks dropped the connection
    t0 = time.monotonic()
    assert wait_until(lambda: eng.get_stats().kv_blocks_used == baseline, 1.0), \
        f"KV blocks not released: {eng.get_stats().kv_blocks_used} vs {baseline}"
    assert time.monotonic() - t0 < 1.0
    assert wait_until(lambda: metric_value(server.metrics_text(), "llmserve_request_aborted_total")
                      > aborted0, 1.0)
    assert metric_value(server.metrics_text(), "llmserve_client_disconnects_total") == gone0 + 1


def _raw_post(server: LiveServer, path: str, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def test_non_streaming_disconnect_aborts_engine_request(server: LiveServer) -> None:
    eng = server.engine
    wait_idle(eng)
    baseline = eng.get_stats().kv_blocks_used
    aborted0 = metric_value(server.metrics_text(), "llmserve_request_aborted_total")
    sock = _raw_post(server, "/v1/completions",
                     {"prompt": "Keep talking", "max_tokens": long_generation(server),
                      "ignore_eos": True})
    try:
        assert wait_until(lambda: eng.get_stats().kv_blocks_used > baseline, 10.0)
    finally:
        sock.close()
    assert wait_until(lambda: eng.get_stats().kv_blocks_used == baseline, 1.0)
    assert wait_until(lambda: metric_value(server.metrics_text(), "llmserve_request_aborted_total")
                      > aborted0, 1.0)


def test_event_loop_stays_responsive_during_streams(server: LiveServer) -> None:
    body = chat_body(max_tokens=long_generation(server), ignore_eos=True, stream=True)
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url("/v1/chat/completions"), json=body) as r:
            lines = r.iter_lines()  # keep a reference: a closed iterator drops the connection
            next(lines)
            t0 = time.monotonic()
            assert httpx.get(server.url("/health"), timeout=5).status_code == 200
            assert httpx.get(server.url("/metrics"), timeout=5).status_code == 200
            assert time.monotonic() - t0 < 1.0
            assert server.engine.get_stats().num_running >= 1  # the stream was still going
