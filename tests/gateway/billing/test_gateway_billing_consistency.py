"""Billing that is the same whatever the client sent (issue 13, defects 6 and 7), and the
rejection counter, in a real in-process HTTP server over the fake engine with a real
SQLite ledger."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Optional

import httpx
import pytest

from llmserve.gateway.hook import build_gateway
from llmserve.protocol import CompletionOutput, RequestMetrics, RequestOutput
from tests.gateway.gateway_server_helpers import auth, ledger_rows, write_config
from tests.server.conftest import LiveServer
from tests.server.server_fakes import FakeEngine
from tests.server.server_helpers import assert_openai_error, metric_value, wait_until

KEYS = {"beta": "sk-beta", "tiny": "sk-tiny"}
TENANTS = {"beta": {}, "tiny": {"requests_per_minute": 1, "request_burst": 1}}
CHAT = "/v1/chat/completions"
UNSCHEDULED = "__deadline_passed_in_queue__"
SLOW_START = "__slow_first_token__"


class QueueingFakeEngine(FakeEngine):
    """A fake engine that can end a request by its deadline before scheduling it, or
    start one late (so a client that leaves early surely leaves before any response)."""

    async def generate(self, prompt: Any, params: Any, request_id: str, **kw: Any
                       ) -> AsyncIterator[RequestOutput]:
        kw.pop("queue_deadline", None)   # the base fake does not take it
        ids = list(prompt)
        if UNSCHEDULED in self.tokenizer.decode(ids):
            metrics = RequestMetrics(arrival_time=time.time(), finished_time=time.time())
            yield RequestOutput(request_id, None, ids, [CompletionOutput(0, finish_reason="timeout")],
                                finished=True, metrics=metrics)
            return
        if SLOW_START in self.tokenizer.decode(ids):
            await asyncio.sleep(1.0)
        async for out in super().generate(prompt, params, request_id, **kw):
            yield out


def chat(content: str = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": "big", "messages": [{"role": "user", "content": content}], "max_tokens": 5, **kw}


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveServer]:
    engine = QueueingFakeEngine(token_delay=0.1)
    config = write_config(tmp_path, TENANTS, KEYS, database="ledger.db")
    gateway = build_gateway(str(config), engine, served_model_names=["big"])
    server = LiveServer(engine, served_model_names=["big"], gateway=gateway,
                        max_body_bytes=64 * 1024).start()
    server.db = tmp_path / "ledger.db"  # type: ignore[attr-defined]
    yield server
    server.stop()


def drop(live: LiveServer, body: dict[str, Any], after_s: float, key: Optional[str] = None) -> str:
    """Send a request and go away after ``after_s``; returns its X-Request-Id."""
    request_id = f"drop-{time.monotonic_ns()}"
    headers = auth(KEYS["beta"], **{"X-Request-Id": request_id})
    if key:
        headers["Idempotency-Key"] = key
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(timeout=after_s) as client:
            with client.stream("POST", live.url(CHAT), json=body, headers=headers) as resp:
                for _ in resp.iter_lines():
                    pass
    return request_id


def row_of(live: LiveServer, request_id: str) -> dict[str, Any]:
    assert wait_until(lambda: any(r["request_id"].startswith(request_id + ".")
                                  for r in ledger_rows(live.db)), 5), f"no row for {request_id}"
    row, = [r for r in ledger_rows(live.db) if r["request_id"].startswith(request_id + ".")]
    return row


@pytest.mark.parametrize("stream, after_s", [(False, 0.45), (True, 0.05)])
def test_a_dropped_request_is_billed_the_same_with_or_without_a_key(live, stream, after_s) -> None:
    # a stream's headers go out with its first token: that token comes a second after the
    # client left, so the server has surely seen the disconnect on a loaded machine
    body = chat(SLOW_START if stream else "hello", max_tokens=40, ignore_eos=True, stream=stream)
    plain = row_of(live, drop(live, body, after_s))
    keyed = row_of(live, drop(live, body, after_s, key=f"k-{stream}"))
    assert plain["status"] == keyed["status"] == 499        # the client left before a response
    assert plain["finish_reason"] == keyed["finish_reason"] == "abort"
    assert keyed["idempotency_key"] == f"k-{stream}" and plain["idempotency_key"] is None
    assert plain["prompt_tokens"] == keyed["prompt_tokens"]
    if not stream:  # it ran a few steps before the client left
        assert plain["completion_tokens"] > 0 and keyed["completion_tokens"] > 0


def test_a_request_whose_deadline_passed_in_the_queue_is_billed_nothing(live) -> None:
    r = httpx.post(live.url(CHAT), json=chat(UNSCHEDULED), headers=auth(KEYS["beta"]), timeout=10)
    assert_openai_error(r, 503, code="timeout")
    row, = ledger_rows(live.db, request_id=r.headers["x-request-id"])
    assert (row["finish_reason"], row["status"]) == ("timeout", 503)
    assert row["prompt_tokens"] == row["cached_tokens"] == row["completion_tokens"] == 0


def test_rejections_are_counted_by_reason(live) -> None:
    def rejected(reason: str) -> float:
        return metric_value(live.metrics_text(), "llmserve_requests_rejected_total", reason=reason)

    before = {reason: rejected(reason) for reason in
              ("auth", "rate_limit", "too_large", "invalid", "timeout")}
    assert httpx.post(live.url(CHAT), json=chat(), timeout=10).status_code == 401
    assert httpx.post(live.url(CHAT), json=chat(), headers=auth(KEYS["tiny"]), timeout=10).status_code == 200
    assert httpx.post(live.url(CHAT), json=chat(), headers=auth(KEYS["tiny"]), timeout=10).status_code == 429
    big = chat("x" * 70_000)
    assert httpx.post(live.url(CHAT), json=big, headers=auth(KEYS["beta"]), timeout=10).status_code == 413
    assert httpx.post(live.url(CHAT), json={"model": "big"}, headers=auth(KEYS["beta"]),
                      timeout=10).status_code == 400
    assert httpx.post(live.url(CHAT), json=chat(UNSCHEDULED), headers=auth(KEYS["beta"]),
                      timeout=10).status_code == 503
    after = {reason: rejected(reason) for reason in before}
    assert {reason: after[reason] - before[reason] for reason in before} == {
        "auth": 1, "rate_limit": 1, "too_large": 1, "invalid": 1, "timeout": 1}


class CorruptingGateway:
    """Wraps the real gateway: after it admits a request, a header value with a line break
    is added (as a name that slipped past validation would be), or, for prompts that ask,
    the engine's logprobs become NaN (a body that JSON cannot encode)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def admit(self, ctx: Any) -> None:
        await self.inner.admit(ctx)
        if "__bad_header__" in ctx.raw_body.decode():
            ctx.response_headers["X-Release"] = "v1\r\nX-Injected: yes"


class NanLogprobEngine(QueueingFakeEngine):
    async def generate(self, prompt: Any, params: Any, request_id: str, **kw: Any
                       ) -> AsyncIterator[RequestOutput]:
        nan = "__nan_body__" in self.tokenizer.decode(list(prompt))
        async for out in super().generate(prompt, params, request_id, **kw):
            for c in out.outputs:
                for lp in c.logprobs or []:
                    if nan:
                        lp.logprob = float("nan")
            yield out


@pytest.fixture
def corrupting(tmp_path: Path) -> Iterator[LiveServer]:
    engine = NanLogprobEngine(token_delay=0.01)
    config = write_config(tmp_path, TENANTS, KEYS, database="ledger.db")
    gateway = CorruptingGateway(build_gateway(str(config), engine, served_model_names=["big"]))
    server = LiveServer(engine, served_model_names=["big"], gateway=gateway).start()
    server.db = tmp_path / "ledger.db"  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.mark.parametrize("content, stream", [("__bad_header__", False), ("__bad_header__", True),
                                             ("__nan_body__", False), ("__nan_body__", True)])
def test_a_response_that_cannot_be_sent_is_not_billed_200_nor_replayed(corrupting, content,
                                                                       stream) -> None:
    """Issue 33, finding 2: the client gets a 500 with a JSON error instead of an empty
    reply, the ledger records a 500, and a retry with the same Idempotency-Key runs again
    (it is not served the broken response from the store)."""
    body = chat(content, stream=stream, logprobs=True)
    for attempt in range(2):
        headers = auth(KEYS["beta"], **{"Idempotency-Key": f"k-{content}-{stream}",
                                        "X-Request-Id": f"r{attempt}-{content}-{stream}"})
        r = httpx.post(corrupting.url(CHAT), json=body, headers=headers, timeout=30)
        if stream and content == "__nan_body__":   # started: the error is its last event
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert r.status_code == 200 and events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["code"] == "internal_error", events
            assert all("NaN" not in e for e in events)
            rows = [r for r in ledger_rows(corrupting.db)
                    if r["request_id"].split(".")[0] == f"r{attempt}-{content}-{stream}"]
            assert [row["finish_reason"] for row in rows] == ["error"], rows   # not replayed
            continue
        err = assert_openai_error(r, 500, code="internal_error")
        assert "cannot be sent" in err["message"] or "could not be encoded" in err["message"]
        assert "idempotent-replayed" not in r.headers and "x-injected" not in r.headers
        rid = f"r{attempt}-{content}-{stream}"
        if content == "__nan_body__":   # it ran: billed what it used, as a 500
            assert wait_until(lambda: any(r["request_id"].split(".")[0] == rid
                                          for r in ledger_rows(corrupting.db)), 5), rid
        rows = [r for r in ledger_rows(corrupting.db) if r["request_id"].split(".")[0] == rid]
        assert [r["status"] for r in rows] == [500] * len(rows), rows
        if content == "__bad_header__":   # refused before the engine ran: nothing to bill
            assert rows == [] and not any(c["request_id"].startswith(rid)
                                          for c in corrupting.engine.calls)
    if not stream or content == "__bad_header__":
        assert not ledger_rows(corrupting.db, status=200)
    # the server goes on answering everyone else
    r = httpx.post(corrupting.url(CHAT), json=chat("fine"), headers=auth(KEYS["beta"]), timeout=30)
    assert r.status_code == 200, r.text
