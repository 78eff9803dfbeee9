"""Releases against a real HTTP server (uvicorn in a thread) over fake engines, through
the official openai client: the canary split, tenant pins, sampling defaults, the
release headers and ledger columns, the automatic rollback of a canary whose target
cannot hold its requests, shadow comparisons kept out of the ledger, a switch under
concurrent load, the admin endpoints and their audit log, the billing export by release.
"""
from __future__ import annotations

import concurrent.futures as cf
import csv
import io
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest

from llmserve.gateway import hash_api_key
from llmserve.gateway.billing.ledger import BillingLedger
from llmserve.gateway.cli_commands import run_billing_export
from llmserve.gateway.config.gateway_config import GatewayConfig
from llmserve.gateway.hook import TenantGateway
from tests.server.conftest import LiveServer
from tests.server.server_fakes import FakeEngine
from tests.server.server_helpers import metric_value, wait_until

KEYS = {"acme": "sk-acme-" + uuid.uuid4().hex, "pinned": "sk-pin-" + uuid.uuid4().hex}
ADMIN = "sk-admin-" + uuid.uuid4().hex


def config(db: Path, **chat: Any) -> GatewayConfig:
    releases = {"chat": {
        "stable": "v1",
        "versions": {
            "v1": {"target": "m-v1", "sampling": {"max_tokens": 3, "temperature": 0}},
            "v2": {"target": "m-v2", "sampling": {"max_tokens": 2}},
            "v3": {"target": "m-small", "sampling": {"max_tokens": 2}}},
        "health": {"window_s": 30, "min_requests": 5, "max_error_rate": 0.2},
        **chat}}
    return GatewayConfig.from_dict({
        "database": str(db), "admin": {"keys": [hash_api_key(ADMIN)]},
        "tenants": {name: {"keys": [hash_api_key(key)]} for name, key in KEYS.items()},
        "releases": releases})


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    started: list[LiveServer] = []

    def start(**chat: Any) -> LiveServer:
        engines = {"m-v1": FakeEngine(model_name="m-v1", fingerprint="fp-v1-0123456789"),
                   "m-v2": FakeEngine(model_name="m-v2", fingerprint="fp-v2-0123456789"),
                   "m-small": FakeEngine(model_name="m-small", max_model_len=8,
                                         fingerprint="fp-small-0123456789")}
        cfg = config(tmp_path / "ledger.db", **chat)
        gateway = TenantGateway(cfg, engines, ledger=BillingLedger(cfg.database))
        first = engines.pop("m-v1")
        live = LiveServer(first, served_model_names=["m-v1"], engines=engines,
                          gateway=gateway).start()
        live.db = tmp_path / "ledger.db"  # type: ignore[attr-defined]
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


def client(live: LiveServer, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url("/v1"), api_key=KEYS[tenant], max_retries=0)


def ask(c: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    return c.chat.completions.with_raw_response.create(model="chat", **kw)


def rows(db: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute("SELECT * FROM usage ORDER BY record_id")]


def admin(live: LiveServer, method: str, path: str, **body: Any) -> httpx.Response:
    return httpx.request(method, live.url(path), json=body if method == "POST" else None,
                         headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)


def test_split_pins_defaults_headers_and_ledger(serve: Callable[..., LiveServer]) -> None:
    live = serve(canary={"release": "v2", "share": 0.5}, pins={"pinned": "v1"})
    c = client(live)
    seen = {"v1": 0, "v2": 0}
    for _ in range(60):
        raw = ask(c)
        seen[raw.headers["x-llmserve-release"]] += 1
        reply = raw.parse()
        want = 3 if raw.headers["x-llmserve-release"] == "v1" else 2
        assert reply.usage.completion_tokens == want        # the release's max_tokens default
        assert len(raw.headers["x-llmserve-release-fingerprint"]) == 64
    assert 24 <= seen["v1"] <= 36, seen
    explicit = ask(c, max_tokens=5).parse()
    assert explicit.usage.completion_tokens == 5             # a value the client sent wins
    assert "chat" in {m.id for m in c.models.list()}
    assert c.models.retrieve("chat").id == "chat"
    pinned = {ask(client(live, "pinned")).headers["x-llmserve-release"] for _ in range(10)}
    assert pinned == {"v1"}
    ledger = rows(live.db)  # type: ignore[attr-defined]
    assert len(ledger) == 71
    by_release = {r["release_id"] for r in ledger}
    assert by_release == {"v1", "v2"}
    fp = {r["release_id"]: r["release_fingerprint"] for r in ledger}
    assert fp["v1"] != fp["v2"] and all(len(v) == 64 for v in fp.values())
    assert {r["served_model"] for r in ledger if r["release_id"] == "v2"} == {"m-v2"}
    text = httpx.get(live.url("/metrics")).text
    assert metric_value(text, "llmserve_release_requests_total", release="v2") == \
        sum(1 for r in ledger if r["release_id"] == "v2")
    out = io.StringIO()
    args = type("A", (), {"database": str(live.db), "config": None,  # type: ignore[attr-defined]
                          "since": None, "until": None, "tenant": None, "release": "v2",
                          "by_release": False})()
    assert run_billing_export(args, out) == 0
    lines = out.getvalue().strip().splitlines()
    assert len(lines) - 1 == seen["v2"] and all(",v2," in line for line in lines[1:])
    out = io.StringIO()
    args.release, args.by_release = None, True
    assert run_billing_export(args, out) == 0
    summary = {row["release_id"]: row for row in csv.DictReader(io.StringIO(out.getvalue()))}
    assert int(summary["v1"]["requests"]) == seen["v1"] + 11
    assert int(summary["v2"]["requests"]) == seen["v2"]
    assert summary["v2"]["release_fingerprint"] == fp["v2"]


def test_failing_canary_is_rolled_back(serve: Callable[..., LiveServer]) -> None:
    live = serve(canary={"release": "v3", "share": 0.5})
    c = client(live)
    started = time.monotonic()
    failures = 0
    for _ in range(40):
        try:
            ask(c, messages=[{"role": "user", "content": "a longer question than eight"}])
        except openai.BadRequestError as e:
            assert e.code == "context_length_exceeded"
            failures += 1
    assert 5 <= failures <= 10           # rolled back after min_requests failures
    text = httpx.get(live.url("/metrics")).text
    assert metric_value(text, "llmserve_release_rollbacks_total", model="chat", release="v3",
                        reason="error_rate") == 1
    assert metric_value(text, "llmserve_release_share", release="v3") == 0
    assert time.monotonic() - started < 30
    audit = admin(live, "GET", "/admin/releases/audit?model=chat").json()["data"]
    assert audit[-1]["action"] == "auto_rollback" and audit[-1]["actor"] == "auto"
    assert audit[-1]["after"]["canary_share"] == 0


def test_shadow_is_compared_not_billed(serve: Callable[..., LiveServer]) -> None:
    live = serve(shadow={"release": "v2", "share": 1.0})
    c = client(live)
    for _ in range(6):
        assert ask(c).headers["x-llmserve-release"] == "v1"
    assert wait_until(lambda: len(admin(live, "GET", "/admin/releases/shadow").json()["data"])
                      == 6, 10)
    shadow = admin(live, "GET", "/admin/releases/shadow").json()["data"]
    assert {s["served_release"] for s in shadow} == {"v1"}
    assert {s["shadow_release"] for s in shadow} == {"v2"}
    # the shadow runs the served request's own sampling parameters; both fakes write
    # the same sentence, so the answers agree token for token
    assert all(s["exact_match"] == 1 and s["token_agreement"] == 1.0 for s in shadow)
    assert all(s["served_tokens"] == s["shadow_tokens"] > 0 for s in shadow)
    text = httpx.get(live.url("/metrics")).text
    assert metric_value(text, "llmserve_release_shadow_requests_total", release="v2",
                        result="compared") == 6
    assert metric_value(text, "llmserve_release_shadow_agreement", release="v2") == 1.0
    ledger = rows(live.db)  # type: ignore[attr-defined]
    assert len(ledger) == 6 and {r["release_id"] for r in ledger} == {"v1"}
    assert {r["served_model"] for r in ledger} == {"m-v1"}


def test_switch_under_load_fails_nothing(serve: Callable[..., LiveServer]) -> None:
    live = serve(canary={"release": "v2", "share": 0.0})
    c = client(live)

    def one(i: int) -> str:
        return ask(c, max_tokens=20, stream=False).headers["x-llmserve-release"]

    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(80)]
        for share in (0.5, 1.0):
            time.sleep(0.05)
            assert admin(live, "POST", "/admin/releases/chat/split", canary_share=share,
                         reason="ramp").status_code == 200
        r = admin(live, "POST", "/admin/releases/chat/promote")
        assert r.status_code == 200, r.text
        results = [f.result() for f in futures]        # raises if any request failed
    assert set(results) <= {"v1", "v2"} and "v2" in results
    status = admin(live, "GET", "/admin/releases").json()["data"][0]
    assert status["stable"] == "v2" and status["canary"] is None
    assert all(r["in_flight"] == 0 for r in status["releases"].values())
    audit = admin(live, "GET", "/admin/releases/audit").json()["data"]
    assert [a["action"] for a in audit] == ["set_share", "set_share", "promote"]
    assert all(a["actor"].startswith("admin:") for a in audit)
    assert audit[0]["reason"] == "ramp"
    assert ask(c).headers["x-llmserve-release"] == "v2"


def test_admin_errors(serve: Callable[..., LiveServer]) -> None:
    live = serve()
    r = httpx.post(live.url("/admin/releases/chat/rollback"),
                   headers={"Authorization": f"Bearer {KEYS['acme']}"}, json={})
    assert r.status_code == 403
    assert admin(live, "POST", "/admin/releases/nope/promote").status_code == 404
    r = admin(live, "POST", "/admin/releases/chat/split", canary_share=1.5)
    assert r.status_code == 400 and "between 0 and 1" in r.json()["error"]["message"]
    r = admin(live, "POST", "/admin/releases/chat/split", canary="v9")
    assert r.status_code == 400
    r = admin(live, "POST", "/admin/releases/chat/promote")
    assert r.status_code == 400 and "no canary" in r.json()["error"]["message"]


def test_structured_validity_gate_measures_json_answers(serve: Callable[..., LiveServer]) -> None:
    import asyncio

    from llmserve.gateway.releases.gate import structured_validity

    live = serve()

    async def measure() -> float:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEYS['acme']}"}) as c:
            return await structured_validity(c, live.base_url, "m-v1", 8)

    assert asyncio.run(measure()) == 0.0     # the fake writes prose, never JSON


def test_canary_on_an_unserved_target_gets_503_then_rolls_back(
        serve: Callable[..., LiveServer]) -> None:
    live = serve(canary={"release": "v4", "share": 1.0},
                 versions={"v1": {"target": "m-v1"}, "v4": {"target": "m-adapter"}})
    c = client(live)
    codes = []
    for _ in range(8):
        try:
            codes.append(ask(c, max_tokens=2).headers["x-llmserve-release"])
        except openai.APIStatusError as e:
            assert e.status_code == 503 and e.code == "release_unavailable"
            codes.append("503")
    assert codes == ["503"] * 5 + ["v1"] * 3       # min_requests failures, then rolled back
    status = admin(live, "GET", "/admin/releases").json()["data"][0]
    assert status["releases"]["v4"]["served"] is False and status["canary_share"] == 0
