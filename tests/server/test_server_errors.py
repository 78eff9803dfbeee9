"""Bad input always gets a 4xx in the OpenAI error shape, and the server keeps serving."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import LiveServer
from tests.server.server_helpers import assert_openai_error, chat_body, metric_value, parse_sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def post(server: LiveServer, path: str, **kw) -> httpx.Response:
    return httpx.post(server.url(path), timeout=30, **kw)


BAD_BODIES = [
    # (case id, path, raw body or JSON, status, param, code)
    ("malformed-json", CHAT, b'{"messages": [', 400, None, "invalid_json"),
    ("empty-body", CHAT, b"", 400, None, "invalid_json"),
    ("json-array", CHAT, b"[1, 2]", 400, None, "invalid_json"),
    ("invalid-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None,
     "invalid_encoding"),
    ("unknown-field", CHAT, chat_body(max_token=5), 400, "max_token", "unknown_parameter"),
    ("unknown-message-field", CHAT, {"messages": [{"role": "user", "content": "x", "extra": 1}]},
     400, "messages[0].extra", "unknown_parameter"),
    ("temperature-string", CHAT, chat_body(temperature="hot"), 400, "temperature", "invalid_type"),
    ("max-tokens-float", CHAT, chat_body(max_tokens=5.5), 400, "max_tokens", "invalid_type"),
    ("n-bool", CHAT, chat_body(n=True), 400, "n", "invalid_type"),
    ("n-zero", CHAT, chat_body(n=0), 400, "n", "invalid_value"),
    ("n-zero-completions", COMPLETIONS, {"prompt": "x", "max_tokens": 2, "n": 0}, 400, "n",
     "invalid_value"),
    ("messages-not-list", CHAT, {"messages": "hello"}, 400, "messages", None),
    ("empty-messages", CHAT, {"messages": []}, 400, "messages", None),
    ("missing-messages", CHAT, {"model": None}, 400, "messages", None),
    ("message-without-content", CHAT, {"messages": [{"role": "user"}]}, 400,
     "messages[0].content", None),
    ("image-part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400,
     "messages[0].content[0]", None),
    ("bad-role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role", None),
    ("huge-max-tokens", CHAT, chat_body(max_tokens=10**12), 400, "max_tokens",
     "context_length_exceeded"),
    ("huge-max-completion-tokens", CHAT, chat_body(max_completion_tokens=2**63), 400,
     "max_completion_tokens", "context_length_exceeded"),
    ("zero-max-tokens", CHAT, chat_body(max_tokens=0), 400, "max_tokens", None),
    ("negative-max-tokens", COMPLETIONS, {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", None),
    ("top-p-out-of-range", CHAT, chat_body(top_p=1.5), 400, "top_p", None),
    ("temperature-negative", CHAT, chat_body(temperature=-1), 400, "temperature", None),
    ("n-zero", CHAT, chat_body(n=0), 400, "n", None),
    ("n-huge", CHAT, chat_body(n=100000), 400, "n", None),
    ("top-k-below-minus-one", CHAT, chat_body(top_k=-2), 400, "top_k", None),
    ("min-tokens-above-max", CHAT, chat_body(max_tokens=2, min_tokens=5), 400, "min_tokens",
     "incompatible_parameters"),
    ("top-logprobs-without-logprobs", CHAT, chat_body(top_logprobs=2), 400, "top_logprobs",
     "incompatible_parameters"),
    ("top-logprobs-too-many", CHAT, chat_body(logprobs=True, top_logprobs=50), 400,
     "top_logprobs", None),
    ("stream-options-without-stream", CHAT, chat_body(stream_options={"include_usage": True}), 400,
     "stream_options", "incompatible_parameters"),
    ("bad-priority", CHAT, chat_body(priority="urgent"), 400, "priority", None),
    ("empty-stop-string", CHAT, chat_body(stop=[""]), 400, "stop", None),
    ("logit-bias-key", CHAT, chat_body(logit_bias={"five": 10}), 400, "logit_bias", None),
    ("logit-bias-value", CHAT, chat_body(logit_bias={"5": 101}), 400, "logit_bias", None),
    ("tools", CHAT, chat_body(tools=[{"type": "function"}]), 400, "tools[0]", None),
    ("tool-choice-unknown", CHAT, chat_body(tools=[{"type": "function", "function": {
        "name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "tool_choice", None),
    ("schema-feature", CHAT, chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}), 400,
     "response_format.json_schema.schema", "unsupported_schema"),
    ("bad-regex", CHAT, chat_body(structured_outputs={"regex": "(?=a)a"}), 400,
     "structured_outputs.regex", "unsupported_schema"),
    ("response-format-type", CHAT, chat_body(response_format={"type": "xml"}), 400,
     "response_format.type", None),
    ("modalities-audio", CHAT, chat_body(modalities=["text", "audio"]), 400, "modalities", None),
    ("missing-prompt", COMPLETIONS, {"max_tokens": 3}, 400, "prompt", "missing_required_parameter"),
    ("empty-prompt-list", COMPLETIONS, {"prompt": []}, 400, "prompt", None),
    ("empty-prompt-string", COMPLETIONS, {"prompt": ""}, 400, "prompt", None),
    ("mixed-prompt-list", COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt", "invalid_type"),
    ("negative-token-id", COMPLETIONS, {"prompt": [1, -2]}, 400, "prompt", None),
    ("token-id-out-of-vocab", COMPLETIONS, {"prompt": [10**9]}, 400, "prompt", None),
    ("suffix-without-fim", COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, "suffix", None),
    ("best-of-below-n", COMPLETIONS, {"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of", None),
    ("max-tokens-zero-without-echo", COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400,
     "max_tokens", None),
    ("completion-logprobs-too-many", COMPLETIONS, {"prompt": "x", "logprobs": 99}, 400, "logprobs",
     None),
    ("nan", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
     "temperature", None),
]


@pytest.mark.parametrize("case", BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_input_gets_openai_error(server: LiveServer, case: tuple) -> None:
    _, path, body, status, param, code = case
    if isinstance(body, bytes):
        resp = post(server, path, content=body, headers={"content-type": "application/json"})
    else:
        resp = post(server, path, json=body)
    assert_openai_error(resp, status, param=param, code=code)


def test_empty_suffix_is_no_suffix(server: LiveServer) -> None:
    """The schema allows any string; "" asks for nothing after the completion, so it is
    served like no suffix (a non-empty one needs fill-in-the-middle tokens)."""
    r = post(server, COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "suffix": ""})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_context_length_exceeded_by_prompt(server: LiveServer) -> None:
    # > 64 KiB of JSON, so the body is also parsed off the event loop
    long_prompt = "word " * max(server.engine.max_model_len * 2, 15000)
    err = assert_openai_error(post(server, COMPLETIONS, json={"prompt": long_prompt}), 400,
                              code="context_length_exceeded")
    assert str(server.engine.max_model_len) in err["message"]
    # with max_tokens omitted the remaining context is filled; a prompt that fills it all fails
    err = assert_openai_error(post(server, CHAT, json=chat_body(long_prompt)), 400,
                              param="messages", code="context_length_exceeded")


def test_unknown_model_routes_and_methods(server: LiveServer) -> None:
    assert_openai_error(post(server, CHAT, json=chat_body(model="nope")), 404, param="model",
                        code="model_not_found")
    assert_openai_error(httpx.get(server.url("/v1/nothing-here")), 404)
    assert_openai_error(httpx.get(server.url(CHAT)), 405)


def test_missing_model_field_is_default(server: LiveServer) -> None:
    r = post(server, CHAT, json=chat_body(max_tokens=2))
    assert r.status_code == 200 and r.json()["model"] == server.engine.model_name


def test_errors_are_counted_and_server_keeps_serving(server: LiveServer) -> None:
    before = metric_value(server.metrics_text(), "llmserve_http_requests_total",
                          endpoint="chat_completions", status_class="4xx")
    for body in (b"{", b"\x80", b'{"messages": 3}'):
        assert post(server, CHAT, content=body).status_code == 400
    after = metric_value(server.metrics_text(), "llmserve_http_requests_total",
                         endpoint="chat_completions", status_class="4xx")
    assert after == before + 3
    ok = post(server, CHAT, json=chat_body(max_tokens=3))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


# -- fake-engine-only failure paths ---------------------------------------------------


def test_engine_value_error_is_400_streaming_or_not(fake_server: LiveServer) -> None:
    for stream in (False, True):
        r = post(fake_server, CHAT, json=chat_body("__engine_value_error__", stream=stream))
        assert_openai_error(r, 400)
    assert fake_server.engine.get_stats().kv_blocks_used == 0


def test_engine_crash_is_500_in_openai_shape(fake_server: LiveServer) -> None:
    for stream in (False, True):
        r = post(fake_server, COMPLETIONS, json={"prompt": "__engine_crash__", "stream": stream},
                 headers={"X-Request-Id": f"crash-{stream}"})
        err = assert_openai_error(r, 500, code="internal_error")
        assert err["type"] == "server_error" and "crashed" not in err["message"]
        assert r.headers["x-request-id"] == f"crash-{stream}"
    assert post(fake_server, COMPLETIONS, json={"prompt": "fine"}).status_code == 200


def test_crash_mid_stream_sends_error_event_then_done(fake_server: LiveServer) -> None:
    r = post(fake_server, COMPLETIONS, json={"prompt": "__crash_midstream__", "stream": True,
                                            "max_tokens": 50, "ignore_eos": True})
    assert r.status_code == 200
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error"
    assert any("choices" in e for e in events[:-2])
    assert fake_server.engine.get_stats().kv_blocks_used == 0


def test_queue_timeout_without_output_is_503(fake_server: LiveServer) -> None:
    for stream in (False, True):
        r = post(fake_server, CHAT, json=chat_body("__queue_timeout__", stream=stream))
        assert_openai_error(r, 503, code="queue_timeout")
        assert r.headers["retry-after"] == "1"


def test_body_too_large_is_413(fake_server: LiveServer) -> None:
    r = post(fake_server, COMPLETIONS, json={"prompt": "x" * (300 * 1024)})
    assert_openai_error(r, 413, code="request_too_large")
    assert post(fake_server, COMPLETIONS, json={"prompt": "ok"}).status_code == 200


def test_ready_and_health(fake_server: LiveServer) -> None:
    assert httpx.get(fake_server.url("/health")).json() == {"status": "ok"}
    assert httpx.get(fake_server.url("/ready")).status_code == 200
    fake_server.engine.ready = False
    try:
        assert_openai_error(httpx.get(fake_server.url("/ready")), 503, code="engine_not_ready")
        assert httpx.get(fake_server.url("/health")).status_code == 200
    finally:
        fake_server.engine.ready = True


def test_openapi_documents_what_the_routes_answer(server: LiveServer) -> None:
    """/metrics is Prometheus text (not JSON) and /v1/models/{id} may answer 404, as served."""
    spec = httpx.get(server.url("/openapi.json"), timeout=30).json()
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain; version=0.0.4; charset=utf-8"]
    assert httpx.get(server.url("/metrics"), timeout=30).headers["content-type"].startswith(
        "text/plain")
    model = spec["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    assert "404" in model
    assert httpx.get(server.url("/v1/models/nope"), timeout=30).status_code == 404
