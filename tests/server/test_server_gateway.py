"""The gateway hook: authenticate, admit (priority / cache_salt / deadline), on_complete."""
from __future__ import annotations

import time
from typing import Callable

import httpx
import openai
import pytest

from llmserve.contract.errors import OpenAIError
from llmserve.contract.gateway_hook import Gateway, RequestContext, RequestOutcome
from tests.server.conftest import LiveServer
from tests.server.server_fakes import FakeEngine
from tests.server.server_helpers import assert_openai_error, chat_body, wait_until


class RecordingGateway(Gateway):
    """Bearer-token tenants, a per-request token budget, and a log of outcomes."""

    def __init__(self, budget: int = 300) -> None:
        self.budget = budget
        self.admitted: list[RequestContext] = []
        self.completed: list[tuple[RequestContext, RequestOutcome]] = []

    async def authenticate(self, ctx: RequestContext) -> None:
        auth = ctx.headers.get("authorization", "")
        if not auth.startswith("Bearer ") or len(auth) <= 7:
            raise OpenAIError(401, "Missing or invalid API key", code="invalid_api_key")
        ctx.tenant = auth[len("Bearer "):]
        ctx.cache_salt = f"salt-{ctx.tenant}"

    async def admit(self, ctx: RequestContext) -> None:
        if ctx.prompt_tokens + ctx.max_tokens * ctx.num_choices > self.budget:
            raise OpenAIError(429, "Token budget exceeded", code="rate_limit_exceeded",
                              headers={"Retry-After": "3"})
        if ctx.tenant == "batch-tenant":
            ctx.priority = "batch"
        ctx.deadline = time.time() + 30
        self.admitted.append(ctx)

    def on_complete(self, ctx: RequestContext, outcome: RequestOutcome) -> None:
        self.completed.append((ctx, outcome))


@pytest.fixture
def gated(start_server: Callable[..., LiveServer]) -> tuple[LiveServer, RecordingGateway]:
    gw = RecordingGateway()
    return start_server(FakeEngine(), gateway=gw), gw


def test_authentication_is_required_on_v1_only(gated) -> None:
    live, gw = gated
    assert_openai_error(httpx.post(live.url("/v1/chat/completions"), json=chat_body()), 401,
                        code="invalid_api_key")
    assert_openai_error(httpx.get(live.url("/v1/models")), 401)
    # auth runs before the body is parsed: garbage from an anonymous caller is still a 401
    assert_openai_error(httpx.post(live.url("/v1/completions"), content=b"{"), 401)
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(live.url(path)).status_code == 200
    assert live.engine.calls == [] and gw.completed == []


def test_admitted_request_carries_gateway_decisions(gated) -> None:
    live, gw = gated
    c = openai.OpenAI(base_url=live.url("/v1"), api_key="alice", max_retries=0)
    resp = c.chat.completions.create(model="fake-model", max_tokens=5,
                                     messages=[{"role": "user", "content": "hi"}],
                                     extra_body={"priority": "interactive", "user": "u-1"})
    call = live.engine.calls[-1]
    assert call["cache_salt"] == "salt-alice"
    assert call["priority"] == "interactive"
    assert call["deadline"] is not None and call["deadline"] > time.time()
    assert [ctx.request_id for ctx in gw.admitted] == [call["request_id"]]
    assert gw.admitted[0].user == "u-1" and gw.admitted[0].max_tokens == 5
    assert gw.admitted[0].prompt_tokens == resp.usage.prompt_tokens
    (ctx, outcome), = gw.completed
    assert outcome.status == "completed"
    assert outcome.usage.completion_tokens == resp.usage.completion_tokens
    assert outcome.usage.prompt_tokens == resp.usage.prompt_tokens
    assert outcome.finish_reasons == [resp.choices[0].finish_reason]

    batch = openai.OpenAI(base_url=live.url("/v1"), api_key="batch-tenant", max_retries=0)
    batch.completions.create(model="fake-model", prompt="x", max_tokens=2)
    assert live.engine.calls[-1]["priority"] == "batch"
    assert live.engine.calls[-1]["cache_salt"] == "salt-batch-tenant"


def test_rejected_admission_never_reaches_engine(gated) -> None:
    live, gw = gated
    r = httpx.post(live.url("/v1/completions"), headers={"Authorization": "Bearer bob"},
                   json={"prompt": "x", "max_tokens": 200, "n": 2})
    assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert r.headers["retry-after"] == "3"
    assert live.engine.calls == [] and gw.completed == []


def test_disconnect_reports_aborted_outcome(gated) -> None:
    live, gw = gated
    body = chat_body(max_tokens=250, ignore_eos=True, stream=True)
    with httpx.Client(timeout=30, headers={"Authorization": "Bearer carol"}) as c:
        with c.stream("POST", live.url("/v1/chat/completions"), json=body) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
    assert wait_until(lambda: len(gw.completed) == 1, 1.0)
    ctx, outcome = gw.completed[0]
    assert outcome.status == "aborted" and ctx.tenant == "carol"
    assert outcome.finish_reasons == [None]
    assert wait_until(lambda: live.engine.get_stats().kv_blocks_used == 0, 1.0)
