"""End to end: the multi-tenant gateway in a real `llmserve serve --config` process.

One server process (the default model served as "big", a second copy of it as the
fallback "small") is started for the module and restarted once, on the same
database, for the last test. Tenants: alpha (may use big and small, fallback
allowed), beta (big only, no fallback) and tiny (a rate limit of 60 requests per
minute with a burst of 2, so an emptied bucket refills within a second).
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
import uuid
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.gateway.gateway_server_helpers import ServerProcess, auth, ledger_rows, write_config
from tests.server.server_helpers import assert_openai_error, metric_value, parse_sse, wait_until

pytestmark = pytest.mark.slow

KEYS = {"alpha": "sk-alpha-" + uuid.uuid4().hex, "beta": "sk-beta-" + uuid.uuid4().hex,
        "tiny": "sk-tiny-" + uuid.uuid4().hex}
QUEUE_TIMEOUT_S = 1.5
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat(content: str = "Name a color.", **kw: Any) -> dict[str, Any]:
    return {"model": "big", "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0, **kw}


def test_metrics_carry_no_tenant_by_default(gw: ServerProcess) -> None:
    """/metrics needs no key, so without `metrics: {per_tenant: true}` no series names a
    tenant or a cache namespace (a hash of one); the aggregates are there. Issue 33."""
    r = httpx.post(gw.url("/v1/completions"), headers=auth(KEYS["alpha"]),
                   json={"model": "big", "prompt": "Hi there", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    text = httpx.get(gw.url("/metrics"), timeout=10).text
    assert 'tenant="' not in text and "cache_namespace" not in text
    assert "alpha" not in text and "tenant:" not in text
    assert metric_value(text, "llmserve_prefix_cache_queries_total", model="big") > 0
    assert metric_value(text, "llmserve_prompt_bundle_pin_budget_blocks") >= 0


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("gateway")
    config = write_config(
        folder, {
            "alpha": {"models": ["big", "small"], "priority": "interactive", "allow_fallback": True},
            "beta": {"models": ["big"]},
            "tiny": {"models": ["big"], "requests_per_minute": 60, "request_burst": 2},
        }, KEYS,
        database="ledger.db", request_timeout_s=60, idempotency_ttl_s=3600,
        queue={"max_requests": 2, "max_tokens": 4096, "timeout_s": QUEUE_TIMEOUT_S},
        models={"big": {"fallback": "small"}},
    )
    server = ServerProcess(config, [
        "--served-model-name", "big", "--fallback-model", "default", "--fallback-name", "small",
        "--num-kv-blocks", "128", "--max-model-len", "1024", "--max-num-seqs", "2",
        "--num-threads", "2", "--responses-store", str(folder / "responses.db")],
        folder / "server.log")
    server.db = folder / "ledger.db"  # type: ignore[attr-defined]
    server.start()
    try:
        for model in ("big", "small"):  # warm up both engines
            r = httpx.post(server.url(CHAT), json=chat(model=model), headers=auth(KEYS["alpha"]),
                           timeout=60)
            assert r.status_code == 200, r.text
        yield server
    finally:
        server.stop()


def post(gw: ServerProcess, tenant: str, body: dict[str, Any], path: str = CHAT,
         **headers: str) -> httpx.Response:
    return httpx.post(gw.url(path), json=body, headers=auth(KEYS[tenant], **headers), timeout=60)


def test_authentication_and_model_permission(gw: ServerProcess) -> None:
    before = len(ledger_rows(gw.db))
    r = httpx.post(gw.url(CHAT), json=chat(), timeout=10)
    assert_openai_error(r, 401, code="missing_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    assert_openai_error(httpx.post(gw.url(CHAT), json=chat(), headers=auth("sk-wrong"), timeout=10),
                        401, code="invalid_api_key")
    assert_openai_error(post(gw, "beta", chat(model="small")), 403, code="model_not_allowed")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url("/v1"), api_key="sk-wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEYS["beta"], max_retries=0)
    assert {m.id for m in client.models.list()} == {"big", "small"}
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model="small", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    resp = client.chat.completions.with_raw_response.create(
        model="big", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    done = resp.parse()
    assert resp.headers["x-served-by"] == "big" and done.model == "big"
    rows = ledger_rows(gw.db)
    assert len(rows) == before + 1  # rejected requests are never billed
    row = rows[-1]
    assert (row["tenant"], row["request_id"], row["status"]) == ("beta", resp.headers["x-request-id"], 200)
    assert row["completion_tokens"] == done.usage.completion_tokens
    assert row["prompt_tokens"] == done.usage.prompt_tokens
    log = {e["request_id"]: e for e in gw.request_log()}[resp.headers["x-request-id"]]
    assert log["tenant"] == "beta" and log["status"] == 200 and log["served_model"] == "big"
    assert log["completion_tokens"] == done.usage.completion_tokens


def test_anthropic_messages_take_x_api_key_limits_and_billing(gw: ServerProcess) -> None:
    """The `anthropic` SDK against the gateway: x-api-key is the tenant's key, a model the
    tenant may not use is a 403, the rate limit a 429 (Anthropic's error bodies), and a
    served message is billed once with its usage."""
    import anthropic

    ask = [{"role": "user", "content": "Name a color."}]
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic.Anthropic(base_url=gw.base_url, api_key="sk-wrong", max_retries=0
                            ).messages.create(model="big", max_tokens=2, messages=ask)
    assert denied.value.body["error"]["type"] == "authentication_error"
    beta = anthropic.Anthropic(base_url=gw.base_url, api_key=KEYS["beta"], max_retries=0)
    with pytest.raises(anthropic.PermissionDeniedError):
        beta.messages.create(model="small", max_tokens=2, messages=ask)
    before = len(ledger_rows(gw.db))
    raw = beta.messages.with_raw_response.create(model="big", max_tokens=3, messages=ask)
    msg = raw.parse()
    rows = ledger_rows(gw.db)
    assert len(rows) == before + 1
    row = rows[-1]
    assert (row["tenant"], row["request_id"], row["status"]) == (
        "beta", raw.headers["x-request-id"], 200)
    assert row["completion_tokens"] == msg.usage.output_tokens
    assert row["prompt_tokens"] == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert beta.messages.count_tokens(model="big", messages=ask).input_tokens \
        == row["prompt_tokens"]
    tiny = anthropic.Anthropic(base_url=gw.base_url, api_key=KEYS["tiny"], max_retries=0)
    with cf.ThreadPoolExecutor(3) as pool:
        outcomes = list(pool.map(lambda _: _try(lambda: tiny.messages.create(
            model="big", max_tokens=2, messages=ask)), range(3)))
    assert sorted(type(o).__name__ for o in outcomes).count("RateLimitError") >= 1
    time.sleep(2)   # the tiny tenant's bucket refills for the tests after this one


def test_responses_under_the_gateway_bill_replay_and_stay_with_their_tenant(
        gw: ServerProcess) -> None:
    """The `openai` SDK's Responses calls against the gateway: the tenant's key, a model it
    may not use is a 403, a served response is billed once, an idempotent retry gives the
    same response (id included) without a second bill, and stored responses are the
    tenant's alone."""
    beta = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEYS["beta"], max_retries=0)
    alpha = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEYS["alpha"], max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url("/v1"), api_key="sk-wrong", max_retries=0
                      ).responses.create(model="big", input="hi", max_output_tokens=2)
    with pytest.raises(openai.PermissionDeniedError):
        beta.responses.create(model="small", input="hi", max_output_tokens=2)
    before = len(ledger_rows(gw.db))
    key = "idem-" + uuid.uuid4().hex
    raw = beta.responses.with_raw_response.create(
        model="big", input="Name a color.", max_output_tokens=3, temperature=0,
        extra_headers={"Idempotency-Key": key})
    resp = raw.parse()
    rows = ledger_rows(gw.db)
    assert len(rows) == before + 1
    assert (rows[-1]["tenant"], rows[-1]["status"]) == ("beta", 200)
    assert rows[-1]["completion_tokens"] == resp.usage.output_tokens
    assert rows[-1]["prompt_tokens"] == resp.usage.input_tokens
    again = beta.responses.with_raw_response.create(
        model="big", input="Name a color.", max_output_tokens=3, temperature=0,
        extra_headers={"Idempotency-Key": key})
    assert again.headers["idempotent-replayed"] == "true"
    assert again.parse().id == resp.id and again.parse().output_text == resp.output_text
    assert len(ledger_rows(gw.db, idempotency_key=key)) == 1
    assert beta.responses.retrieve(resp.id).output_text == resp.output_text
    with pytest.raises(openai.NotFoundError):
        alpha.responses.retrieve(resp.id)
    gw.responses_id = resp.id  # type: ignore[attr-defined]  # read after the restart


def _try(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test compares
        return exc


def test_rate_limit_429_and_recovery(gw: ServerProcess) -> None:
    with cf.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: post(gw, "tiny", chat(max_tokens=2)), range(3)))
    assert sorted(r.status_code for r in results) == [200, 200, 429], [r.text for r in results]
    limited = next(r for r in results if r.status_code == 429)
    assert_openai_error(limited, 429, code="rate_limit_exceeded")
    retry_after = int(limited.headers["retry-after"])
    assert 1 <= retry_after <= 2
    assert ledger_rows(gw.db, request_id=limited.headers["x-request-id"]) == []
    time.sleep(retry_after)
    assert post(gw, "tiny", chat(max_tokens=2)).status_code == 200


def test_tenants_never_share_the_prefix_cache(gw: ServerProcess) -> None:
    prompt = f"[{uuid.uuid4().hex}] " + "The quick brown fox jumps over the lazy dog. " * 20
    body = {"model": "big", "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def cached(tenant: str) -> tuple[int, int]:
        r = post(gw, tenant, body, COMPLETIONS)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    prompt_tokens, first = cached("alpha")
    assert prompt_tokens > 150 and first == 0
    assert cached("beta") == (prompt_tokens, 0)      # same prompt, other tenant: no hit
    assert cached("alpha")[1] >= prompt_tokens - 16  # the same tenant hits all full blocks


def test_overload_gives_200_429_or_503_and_bills_exactly_the_200s(gw: ServerProcess) -> None:
    gw.wait_idle(["big"])
    baseline = gw.kv_used("big")
    ready_codes: list[int] = []
    stop = threading.Event()

    def probe_ready() -> None:
        while not stop.is_set():
            ready_codes.append(httpx.get(gw.url("/ready"), timeout=10).status_code)
            time.sleep(0.05)

    prober = threading.Thread(target=probe_ready)
    prober.start()
    try:
        with cf.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: post(gw, "beta", chat(f"Count to {i}.", max_tokens=8)),
                                    range(8)))
    finally:
        stop.set()
        prober.join()
    codes = [r.status_code for r in results]
    assert set(codes) <= {200, 429, 503}, [r.text for r in results]
    assert 200 in codes and 503 in codes, codes
    assert ready_codes and set(ready_codes) == {200}
    billed_errors = 0
    for r in results:
        rows = ledger_rows(gw.db, request_id=r.headers["x-request-id"])
        if r.status_code == 200:
            assert len(rows) == 1 and rows[0]["status"] == 200
            assert rows[0]["completion_tokens"] == r.json()["usage"]["completion_tokens"]
        elif r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout":
            assert len(rows) == 1 and rows[0]["finish_reason"] == "queue_timeout"
            billed_errors += 1
        else:
            assert_openai_error(r, r.status_code)
            assert "retry-after" in r.headers and rows == []
    assert gw.wait_kv("big", baseline), f"KV blocks stuck at {gw.kv_used('big')}"
    assert httpx.get(gw.url("/ready"), timeout=10).status_code == 200


def _stream_first_event(gw: ServerProcess, tenant: str, body: dict[str, Any], opened: list,
                        **headers: str) -> dict[str, Any]:
    """Open a stream, return its first event and keep the response (to read on or close)."""
    client = httpx.Client(timeout=60)
    resp = client.send(client.build_request("POST", gw.url(CHAT), json=body,
                                            headers=auth(KEYS[tenant], **headers)), stream=True)
    lines = resp.iter_lines()
    opened.append((client, resp, lines))
    assert resp.status_code == 200, resp.read()
    first = next(line for line in lines if line.startswith("data: "))
    return json.loads(first[len("data: "):])


def test_deadline_and_queue_timeout_end_requests_and_free_kv(gw: ServerProcess) -> None:
    gw.wait_idle(["big"])
    baseline = gw.kv_used("big")
    opened: list = []
    long_body = chat("Tell me a long story.", max_tokens=600, ignore_eos=True, stream=True)
    try:
        ids = [_stream_first_event(gw, "beta", long_body, opened, **{"X-Request-Timeout": "5"})["id"]
               for _ in range(2)]
        started = time.monotonic()
        # both engine slots (--max-num-seqs 2) are busy: this one waits, then is dropped
        waited = post(gw, "beta", chat(max_tokens=4))
        assert_openai_error(waited, 503, code="queue_timeout")
        assert time.monotonic() - started >= QUEUE_TIMEOUT_S - 0.1
        rests = [[line for line in lines if line] for _, _, lines in opened]
    finally:
        for client, resp, _ in opened:
            resp.close()
            client.close()
    for rest in rests:  # each stream ended by its deadline, with a finish chunk and [DONE]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    rows = {r["request_id"]: r for r in ledger_rows(gw.db)}
    for rid in ids:
        row = rows[rid.removeprefix("chatcmpl-")]
        assert row["finish_reason"] == "timeout" and 0 < row["completion_tokens"] < 600
    dropped = rows[waited.headers["x-request-id"]]
    assert (dropped["finish_reason"], dropped["status"]) == ("queue_timeout", 503)
    assert dropped["prompt_tokens"] == dropped["completion_tokens"] == 0  # nothing was computed
    assert gw.wait_kv("big", baseline), f"KV blocks stuck at {gw.kv_used('big')}"


def test_overloaded_primary_falls_back_for_tenants_that_allow_it(gw: ServerProcess) -> None:
    gw.wait_idle(["big", "small"])
    base_big, base_small = gw.kv_used("big"), gw.kv_used("small")
    opened: list = []
    long_body = chat("Tell me a long story.", max_tokens=600, ignore_eos=True, stream=True)
    with cf.ThreadPoolExecutor(2) as pool:
        try:
            for _ in range(2):
                _stream_first_event(gw, "beta", long_body, opened)
            queued = [pool.submit(post, gw, "beta", chat(max_tokens=2)) for _ in range(2)]
            assert wait_until(lambda: gw.metric("llmserve_num_requests_waiting", model="big") == 2,
                              5.0, 0.02)
            rejected = post(gw, "beta", chat(max_tokens=2))  # beta may not fall back
            client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEYS["alpha"], max_retries=0)
            raw = client.chat.completions.with_raw_response.create(
                model="big", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        finally:
            for c, resp, _ in opened:
                resp.close()
                c.close()
        queued_codes = sorted(f.result().status_code for f in queued)
    answer = raw.parse()
    assert raw.headers["x-served-by"] == "small" and answer.model == "small"
    assert_openai_error(rejected, 503, code="server_overloaded")
    assert int(rejected.headers["retry-after"]) >= 1
    assert set(queued_codes) <= {200, 503}
    row, = ledger_rows(gw.db, request_id=raw.headers["x-request-id"])
    assert (row["tenant"], row["model"], row["served_model"]) == ("alpha", "big", "small")
    assert gw.wait_kv("big", base_big) and gw.wait_kv("small", base_small)


def test_idempotency_replay_conflict_and_mismatch(gw: ServerProcess) -> None:
    key = "idem-" + uuid.uuid4().hex
    body = chat("Say hello.", max_tokens=6)
    first = post(gw, "beta", body, **{"Idempotency-Key": key})
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers
    again = post(gw, "beta", dict(reversed(list(body.items()))), **{"Idempotency-Key": key})
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert again.headers["x-request-id"] == first.headers["x-request-id"]
    assert_openai_error(post(gw, "beta", chat("Say bye.", max_tokens=6), **{"Idempotency-Key": key}),
                        422, code="idempotency_key_reused")
    other_tenant = post(gw, "alpha", body, **{"Idempotency-Key": key})  # keys are per tenant
    assert other_tenant.status_code == 200 and "idempotent-replayed" not in other_tenant.headers
    assert len(ledger_rows(gw.db, tenant="beta", idempotency_key=key)) == 1
    assert len(ledger_rows(gw.db, tenant="alpha", idempotency_key=key)) == 1

    slow_key = "idem-" + uuid.uuid4().hex
    slow = chat("Write a poem.", max_tokens=60, ignore_eos=True)
    with cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(post, gw, "beta", slow, **{"Idempotency-Key": slow_key})
        assert wait_until(lambda: gw.metric("llmserve_num_requests_running", model="big") >= 1, 10, 0.02)
        assert_openai_error(post(gw, "beta", slow, **{"Idempotency-Key": slow_key}), 409,
                            code="idempotency_key_in_use")
        original = running.result()
    assert original.status_code == 200
    replay = post(gw, "beta", slow, **{"Idempotency-Key": slow_key})
    assert replay.headers["idempotent-replayed"] == "true" and replay.json() == original.json()
    assert len(ledger_rows(gw.db, idempotency_key=slow_key)) == 1


def test_stream_disconnect_then_retry_replays_partial_and_bills_once(gw: ServerProcess) -> None:
    key = "idem-" + uuid.uuid4().hex
    body = chat("Tell me a long story.", max_tokens=300, ignore_eos=True, stream=True)
    before = len(ledger_rows(gw.db))
    received = []
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", gw.url(CHAT), json=body,
                           headers=auth(KEYS["beta"], **{"Idempotency-Key": key})) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            while len(received) < 4:
                line = next(lines)
                if line.startswith("data: "):
                    received.append(json.loads(line[len("data: "):]))
    deadline = time.monotonic() + 10
    while True:  # 409 until the server has seen the disconnect and stored the partial answer
        retry = post(gw, "beta", body, **{"Idempotency-Key": key})
        if retry.status_code != 409 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert retry.status_code == 200 and retry.headers["idempotent-replayed"] == "true", retry.text
    events = parse_sse(retry.text)
    assert events[:len(received)] == received
    assert events[-1] == "[DONE]"
    assert [c["finish_reason"] for c in events[-2]["choices"]] == ["abort"]
    streamed = sum(1 for e in events[1:-2] if e["choices"][0]["delta"].get("content"))
    rows = ledger_rows(gw.db)
    assert len(rows) == before + 1  # the retry was not billed
    row, = [r for r in rows if r["idempotency_key"] == key]
    assert row["finish_reason"] == "abort" and streamed <= row["completion_tokens"] < 300
    assert post(gw, "beta", body, **{"Idempotency-Key": key}).text == retry.text


def test_replay_survives_a_restart(gw: ServerProcess) -> None:
    key = "idem-" + uuid.uuid4().hex
    body = chat("Name a fruit.", max_tokens=5)
    first = post(gw, "alpha", body, **{"Idempotency-Key": key})
    assert first.status_code == 200
    gw.restart()
    replay = post(gw, "alpha", body, **{"Idempotency-Key": key})
    assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == first.json()
    assert len(ledger_rows(gw.db, idempotency_key=key)) == 1
    stored = getattr(gw, "responses_id", None)   # a file store keeps responses across restarts
    if stored is not None:
        r = httpx.get(gw.url(f"/v1/responses/{stored}"), headers=auth(KEYS["beta"]), timeout=10)
        assert r.status_code == 200 and r.json()["id"] == stored
    fresh = post(gw, "alpha", body)  # the restarted server still serves and bills
    assert fresh.status_code == 200
    assert len(ledger_rows(gw.db, request_id=fresh.headers["x-request-id"])) == 1
