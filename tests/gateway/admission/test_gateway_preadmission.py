"""Admission before work (issue 13, defects 4 and 10) in a real in-process HTTP server over
the fake engine: rate limits from the raw body size before parsing and tokenizing,
tokenization charged to the tenant, fair tokenizer threads, the implicit max_tokens
reservation and the X-Request-Timeout cap."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from llmserve.gateway.hook import build_gateway
from tests.gateway.gateway_server_helpers import auth, ledger_rows, write_config
from tests.server.conftest import LiveServer
from tests.server.server_fakes import FakeEngine, FakeTokenizer
from tests.server.server_helpers import assert_openai_error

KEYS = {name: f"sk-{name}" for name in ("free", "tiny", "metered", "hostile", "victim", "small")}
TENANTS = {
    "free": {},
    "tiny": {"requests_per_minute": 1, "request_burst": 1},
    "metered": {"tokens_per_minute": 1000},
    "hostile": {},
    "victim": {},
    "small": {"tokens_per_minute": 200},
}
CHAT = "/v1/chat/completions"
BIG_TEXT_BYTES = 8_400_000


class CountingTokenizer(FakeTokenizer):
    """Counts encode calls; sleeps (without the GIL, like a native tokenizer) on big texts."""

    def __init__(self, slow_above: int = 50_000, slow_s: float = 1.0) -> None:
        self.encoded = 0
        self.slow_above = slow_above
        self.slow_s = slow_s
        self._lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            self.encoded += 1
        if len(text) > self.slow_above:
            time.sleep(self.slow_s)
            return [5] * 100
        return super().encode(text, add_special_tokens)


def chat(content: str = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": "big", "messages": [{"role": "user", "content": content}], "max_tokens": 5, **kw}


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveServer]:
    engine = FakeEngine()
    engine.tokenizer = CountingTokenizer()
    config = write_config(tmp_path, TENANTS, KEYS, database="ledger.db", request_timeout_s=30)
    gateway = build_gateway(str(config), engine, served_model_names=["big"])
    server = LiveServer(engine, served_model_names=["big"], gateway=gateway).start()
    server.db = tmp_path / "ledger.db"  # type: ignore[attr-defined]
    server.gateway = gateway  # type: ignore[attr-defined]
    yield server
    server.stop()


def post(live: LiveServer, tenant: str, body: Any, timeout: float = 60, **headers: str) -> httpx.Response:
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, (bytes, Iterator)) else {"json": body}
    return httpx.post(live.url(CHAT), headers=auth(KEYS[tenant], **headers), timeout=timeout, **kwargs)


def big_body() -> bytes:
    return ('{"model":"big","max_tokens":5,"messages":[{"role":"user","content":"'
            + "x" * BIG_TEXT_BYTES + '"}]}').encode()


def test_empty_bucket_gets_429_for_a_huge_body_before_any_parsing(live: LiveServer) -> None:
    assert post(live, "tiny", chat()).status_code == 200
    encoded = live.engine.tokenizer.encoded
    started = time.monotonic()
    r = post(live, "tiny", big_body())
    assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert int(r.headers["retry-after"]) >= 1
    assert time.monotonic() - started < 2.0
    assert live.engine.tokenizer.encoded == encoded and len(live.engine.calls) == 1

    def chunks() -> Iterator[bytes]:  # no Content-Length: checked right after the read
        body = big_body()
        for i in range(0, len(body), 1 << 20):
            yield body[i:i + (1 << 20)]

    r = post(live, "tiny", chunks())
    assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert live.engine.tokenizer.encoded == encoded and len(ledger_rows(live.db)) == 1


def test_a_body_larger_than_the_token_bucket_is_refused_from_its_size(live: LiveServer) -> None:
    r = post(live, "metered", big_body())       # ~1M tokens by the size estimate > 1000 tpm
    assert_openai_error(r, 400, code="tokens_per_minute_exceeded")
    assert live.engine.tokenizer.encoded == 0


def test_tokenization_is_charged_to_the_tenant_even_when_rejected(live: LiveServer) -> None:
    tenant = live.gateway.config.tenants["metered"]
    prompt = "w" * 300                           # 300 byte-level tokens + the chat template
    r = post(live, "metered", chat(prompt, max_tokens=4000))
    assert_openai_error(r, 400, code="context_length_exceeded")
    _, tokens_left = live.gateway.limiter.remaining(tenant)
    assert tokens_left <= 1000 - 300 + 20      # charged (refill: ~17 tokens/s)
    assert ledger_rows(live.db) == []           # but never billed: the engine ran nothing


def test_a_hostile_tenant_cannot_starve_another_tenants_tokenization(live: LiveServer) -> None:
    body = chat("y" * 60_000)                   # each one takes the slow tokenizer path (1 s)
    with cf.ThreadPoolExecutor(6) as pool:
        hostile = [pool.submit(post, live, "hostile", body) for _ in range(6)]
        time.sleep(0.3)                         # the hostile requests hold the tokenizer now
        started = time.monotonic()
        r = post(live, "victim", chat("Hi"))
        latency = time.monotonic() - started
        assert r.status_code == 200, r.text
        assert latency < 0.8, f"the victim waited {latency:.2f}s"
        assert all(f.result().status_code == 200 for f in hostile)


def test_a_call_without_max_tokens_reserves_an_estimate_not_the_whole_context(live: LiveServer) -> None:
    tenant = live.gateway.config.tenants["small"]
    body = {"model": "big", "messages": [{"role": "user", "content": "hello"}]}
    r = post(live, "small", body)               # 200 tpm, 4096-token context: was a 400
    assert r.status_code == 200, r.text
    used = r.json()["usage"]["total_tokens"]
    _, left = live.gateway.limiter.remaining(tenant)
    assert 200 - used - 1 <= left <= 200 - used + 10   # settled to actual use
    assert_openai_error(post(live, "small", chat(max_tokens=500)), 400,
                        code="tokens_per_minute_exceeded")  # an explicit ask is still checked


def test_x_request_timeout_cannot_exceed_the_configured_timeout(live: LiveServer) -> None:
    started = time.time()
    assert post(live, "free", chat(), **{"X-Request-Timeout": "600"}).status_code == 200
    assert live.engine.calls[-1]["deadline"] <= started + 30.5
    assert post(live, "free", chat(), **{"X-Request-Timeout": "5"}).status_code == 200
    assert live.engine.calls[-1]["deadline"] <= time.time() + 5.01
