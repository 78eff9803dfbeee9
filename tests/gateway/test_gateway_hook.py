"""TenantGateway in a real in-process HTTP server over the fake engine (fast, no model).

The end-to-end tests against the real engine in a server process are in
test_gateway_server.py; these cover the gateway's decisions quickly.
"""
from __future__ import annotations

import concurrent.futures as cf
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from llmserve.gateway.hook import build_gateway
from tests.gateway.gateway_server_helpers import auth, ledger_rows, write_config
from tests.server.conftest import LiveServer
from tests.server.server_fakes import FakeEngine
from tests.server.server_helpers import assert_openai_error, parse_sse, wait_until

KEYS = {"alpha": "sk-alpha-test", "beta": "sk-beta-test", "tiny": "sk-tiny-test"}
TENANTS = {
    "alpha": {"models": ["big", "small"], "priority": "interactive", "allow_fallback": True,
              "max_request_timeout_s": 2},
    "beta": {"models": ["big"]},
    "tiny": {"models": ["big"], "requests_per_minute": 120, "request_burst": 1},
}
CHAT = "/v1/chat/completions"


def chat(content: str = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": "big", "messages": [{"role": "user", "content": content}], "max_tokens": 5, **kw}


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    """``make_server(primary=FakeEngine(), database=True, **top_level_config)``."""
    started: list[LiveServer] = []

    def make(primary: Any = None, database: bool = True, **top: Any) -> LiveServer:
        primary = primary or FakeEngine()
        small = FakeEngine(model_name="fake-small")
        if database:
            top["database"] = "ledger.db"
        config = write_config(tmp_path, TENANTS, KEYS, models={"big": {"fallback": "small"}}, **top)
        gateway = build_gateway(str(config), primary, fallback_engines={"small": small},
                                served_model_names=["big"])
        live = LiveServer(primary, served_model_names=["big"], gateway=gateway,
                          engines={"small": small}).start()
        live.db = tmp_path / "ledger.db"  # type: ignore[attr-defined]
        live.small = small  # type: ignore[attr-defined]
        started.append(live)
        return live

    yield make
    for live in started:
        live.stop()


def post(live: LiveServer, tenant: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(live.url(CHAT), json=body, headers=auth(KEYS[tenant], **headers), timeout=30)


def test_gateway_errors_are_openai_errors_with_headers(make_server) -> None:
    live = make_server()
    r = httpx.post(live.url(CHAT), json=chat(), headers={"Authorization": "Basic abc"})
    assert_openai_error(r, 401, code="invalid_authorization_header")
    assert r.headers["www-authenticate"] == "Bearer"
    assert_openai_error(post(live, "beta", chat(model="small")), 403, code="model_not_allowed")
    assert_openai_error(post(live, "beta", chat(), **{"X-Request-Timeout": "soon"}), 400,
                        code="invalid_request_timeout")
    assert_openai_error(post(live, "beta", chat(), **{"Idempotency-Key": "k" * 256}), 400,
                        code="invalid_idempotency_key")
    assert_openai_error(post(live, "beta", chat(max_tokens=5000)), 400)  # context, before the engine
    assert live.engine.calls == [] and ledger_rows(live.db) == []


def test_salt_priority_and_deadline_come_from_the_tenant(make_server) -> None:
    live = make_server(request_timeout_s=30)
    t0 = time.time()
    assert post(live, "beta", chat(priority="interactive")).status_code == 200
    call = live.engine.calls[-1]
    assert call["cache_salt"] == "tenant:beta"
    assert call["priority"] == "default"          # a tenant cannot raise its class
    assert t0 + 29 < call["deadline"] < time.time() + 30.5
    assert post(live, "alpha", chat(priority="batch"), **{"X-Request-Timeout": "60"}).status_code == 200
    call = live.engine.calls[-1]
    assert call["cache_salt"] == "tenant:alpha" and call["priority"] == "batch"  # lowering is fine
    assert call["deadline"] < time.time() + 2.01   # capped by max_request_timeout_s
    row = ledger_rows(live.db)[-1]
    assert row["tenant"] == "alpha" and row["fingerprint"] == live.engine.fingerprint


def test_streamed_response_is_replayed_byte_for_byte(make_server) -> None:
    live = make_server()
    body = chat(stream=True, stream_options={"include_usage": True}, max_tokens=12)
    first = post(live, "beta", body, **{"Idempotency-Key": "stream-1"})
    events = parse_sse(first.text)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] > 0
    calls = len(live.engine.calls)
    again = post(live, "beta", body, **{"Idempotency-Key": "stream-1"})
    assert again.text == first.text and again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-type"].startswith("text/event-stream")
    assert again.headers["x-served-by"] == "big"
    assert len(live.engine.calls) == calls  # the model did not run again
    assert len(ledger_rows(live.db, idempotency_key="stream-1")) == 1
    assert len(ledger_rows(live.db)) == 1


def test_rejected_request_releases_its_idempotency_key(make_server) -> None:
    live = make_server()
    assert post(live, "tiny", chat()).status_code == 200
    limited = post(live, "tiny", chat(), **{"Idempotency-Key": "k-1"})
    assert_openai_error(limited, 429, code="rate_limit_exceeded")
    assert limited.headers["retry-after"] == "1"
    time.sleep(0.55)  # 120 rpm: one request every 0.5 s
    retry = post(live, "tiny", chat(), **{"Idempotency-Key": "k-1"})
    assert retry.status_code == 200 and "idempotent-replayed" not in retry.headers
    assert len(ledger_rows(live.db, idempotency_key="k-1")) == 1


def test_fallback_when_the_primary_queue_is_full(make_server) -> None:
    live = make_server(primary=FakeEngine(token_delay=0.4), queue={"max_requests": 1})
    with cf.ThreadPoolExecutor(1) as pool:
        holder = pool.submit(post, live, "beta", chat(max_tokens=2))
        assert wait_until(lambda: len(live.engine.calls) == 1, 5)  # queued until its first token
        fallback = post(live, "alpha", chat())
        overloaded = post(live, "beta", chat())
        assert holder.result().status_code == 200
    assert fallback.status_code == 200, fallback.text
    assert fallback.headers["x-served-by"] == "small" and fallback.json()["model"] == "small"
    assert len(live.small.calls) == 1 and len(live.engine.calls) == 1
    assert_openai_error(overloaded, 503, code="server_overloaded")
    assert int(overloaded.headers["retry-after"]) >= 1
    row, = ledger_rows(live.db, request_id=fallback.headers["x-request-id"])
    assert (row["model"], row["served_model"], row["fingerprint"]) == (
        "big", "small", live.small.fingerprint)


def test_without_a_database_idempotency_keys_are_refused(make_server) -> None:
    live = make_server(database=False)
    assert_openai_error(post(live, "beta", chat(), **{"Idempotency-Key": "x"}), 400,
                        code="idempotency_not_enabled")
    assert post(live, "beta", chat()).status_code == 200
    with pytest.raises(sqlite3.OperationalError):
        ledger_rows(live.db)


def test_non_streamed_request_whose_client_left_replays_the_partial_answer(make_server) -> None:
    live = make_server(primary=FakeEngine(token_delay=0.1))
    body = chat(max_tokens=40, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url(CHAT), json=body, timeout=0.6,
                   headers=auth(KEYS["beta"], **{"Idempotency-Key": "gone"}))
    assert wait_until(lambda: len(ledger_rows(live.db)) == 1, 5)
    row, = ledger_rows(live.db)
    assert row["finish_reason"] == "abort" and 0 < row["completion_tokens"] < 40
    replay = post(live, "beta", body, **{"Idempotency-Key": "gone"})
    assert replay.headers["idempotent-replayed"] == "true"
    choice = replay.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["message"]["content"]
    assert replay.json()["usage"]["completion_tokens"] == row["completion_tokens"]
    assert len(live.engine.calls) == 1 and len(ledger_rows(live.db)) == 1
