"""The ``releases`` config section, release fingerprints, the split table, the health
window and the stored split (no server)."""
from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest

from llmserve.gateway import hash_api_key
from llmserve.gateway.config.gateway_config import GatewayConfig
from llmserve.gateway.releases.config import HealthThresholds
from llmserve.gateway.releases.health import ReleaseHealth, is_release_failure
from llmserve.gateway.releases.routing import ReleaseRouting
from llmserve.gateway.releases.table import ReleaseTable, ReleaseUnavailable, resolve_release
from llmserve.server.protocol.openai import ChatCompletionRequest
from llmserve.server.sampling_defaults import apply_sampling_defaults
from tests.server.server_fakes import FakeEngine

BASE: dict[str, Any] = {
    "tenants": {"acme": {"keys": [hash_api_key("sk-acme")]}},
    "releases": {"chat": {
        "stable": "v1", "canary": {"release": "v2", "share": 0.25},
        "pins": {"acme": "v1"}, "shadow": {"release": "v2", "share": 0.1},
        "versions": {"v1": {"target": "a", "sampling": {"temperature": 0.5, "max_tokens": 8}},
                     "v2": {"target": "b", "quantization": "int8"}}}},
}


def load(**edits: Any) -> GatewayConfig:
    data = copy.deepcopy(BASE)
    chat = data["releases"]["chat"]
    for path, value in edits.items():
        keys = path.split("__")
        node = chat
        for key in keys[:-1]:
            node = node[key]
        if value is None:
            node.pop(keys[-1])
        else:
            node[keys[-1]] = value
    return GatewayConfig.from_dict(data)


def test_valid_config_parses() -> None:
    chat = load().releases["chat"]
    assert chat.stable == "v1" and chat.canary == "v2" and chat.canary_share == 0.25
    assert chat.pins == {"acme": "v1"} and chat.shadow_share == 0.1
    assert chat.versions["v1"].sampling == {"temperature": 0.5, "max_tokens": 8}
    assert chat.versions["v2"].identity == {"quantization": "int8"}


@pytest.mark.parametrize("edits, message", [
    ({"stable": None}, "releases.chat.stable: required"),
    ({"stable": "v9"}, "releases.chat.stable: 'v9' is not one of this model's versions"),
    ({"canary__share": 1.5}, "releases.chat.canary.share: must be between 0 and 1"),
    ({"canary__share": None}, "releases.chat.canary.share: required"),
    ({"canary__release": "v1"}, "releases.chat.canary.release: 'v1' is the stable release"),
    ({"pins": {"nobody": "v1"}}, "releases.chat.pins.nobody: no tenant 'nobody'"),
    ({"pins": {"acme": "v7"}}, "releases.chat.pins.acme: 'v7' is not one of"),
    ({"shadow__speed": 1}, "releases.chat.shadow.speed: unknown key"),
    ({"versions__v1__target": None}, "releases.chat.versions.v1.target: required"),
    ({"versions__v1__sampling": {"top_p": 0}}, "releases.chat.versions.v1.sampling.top_p"),
    ({"versions__v1__sampling": {"max_tokens": 0}}, "sampling.max_tokens: must be at least 1"),
    ({"versions__v1__sampling": {"beam": 2}}, "sampling.beam: unknown key"),
    ({"versions__v2__weights": 5}, "releases.chat.versions.v2.weights: expected a non-empty"),
    ({"health": {"max_error_rate": 2}}, "releases.chat.health.max_error_rate: must be between"),
    ({"gates": {"min_greedy_agreement": "high"}}, "gates.min_greedy_agreement: expected a number"),
    ({"versions": {}}, "releases.chat.versions: required"),
])
def test_invalid_config_names_the_place(edits: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        load(**edits)
    assert message in str(err.value)


def test_release_ids_unique_across_models() -> None:
    data = copy.deepcopy(BASE)
    data["releases"]["code"] = {"stable": "v1", "versions": {"v1": {"target": "a"}}}
    with pytest.raises(ValueError, match="release id already used by releases.chat"):
        GatewayConfig.from_dict(data)


def engines() -> dict[str, FakeEngine]:
    return {"a": FakeEngine(model_name="a", fingerprint="fp-a-0123456789"),
            "b": FakeEngine(model_name="b", fingerprint="fp-b-0123456789")}


def test_unserved_target_resolves_once_served() -> None:
    config = load(shadow=None, pins={}, canary__share=1.0)
    served: dict[str, FakeEngine] = {"a": FakeEngine(model_name="a")}
    table = ReleaseTable(config.releases, served.get)      # "b" (say, an adapter) comes later
    with pytest.raises(ReleaseUnavailable, match="'b' is not served"):
        table.choose("chat", "acme")
    assert table.snapshot("chat")["releases"]["v2"]["served"] is False
    served["b"] = engines()["b"]
    assert table.choose("chat", "acme")[0].target == "b"
    assert table.snapshot("chat")["releases"]["v2"]["fingerprint"] is not None
    with pytest.raises(ValueError, match="also a served model name"):
        ReleaseTable(config.releases, {**engines(), "chat": FakeEngine()})


def test_fingerprint_covers_identity_and_sampling() -> None:
    spec = load().releases["chat"].versions["v1"]
    eng = engines()["a"]
    first = resolve_release(spec, "chat", eng)
    assert first.fingerprint == resolve_release(spec, "chat", eng).fingerprint
    changed = type(spec)(id="v1", target="a", sampling={"temperature": 0.6, "max_tokens": 8})
    assert resolve_release(changed, "chat", eng).fingerprint != first.fingerprint
    other = FakeEngine(model_name="a", fingerprint="fp-other-0123")
    assert resolve_release(spec, "chat", other).fingerprint != first.fingerprint
    assert first.identity["tokenizer"] is None or isinstance(first.identity["tokenizer"], str)


def test_adapter_identity_from_a_lora_view() -> None:
    spec = load().releases["chat"].versions["v1"]
    base = resolve_release(spec, "chat", engines()["a"])
    view = engines()["a"]
    view.lora_info = {"content_hash": "c0ffee" * 8}  # type: ignore[attr-defined]
    release = resolve_release(spec, "chat", view)
    assert base.identity["adapter"] is None and release.identity["adapter"] == "c0ffee" * 8
    assert release.fingerprint != base.fingerprint


def test_pinned_identity_must_match_the_engine() -> None:
    spec = load().releases["chat"].versions["v2"]
    eng = engines()["b"]
    eng.fingerprint_parts = lambda: {"quantization": "fp8"}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="pins 'int8' but served model 'b' has 'fp8'"):
        resolve_release(spec, "chat", eng)


def test_weighted_round_robin_and_pins() -> None:
    table = ReleaseTable(load(shadow=None).releases, engines())
    picks = [table.choose("chat", "other")[0].id for _ in range(400)]
    assert picks.count("v2") == 100                       # exactly the 25 % share
    assert max(len(list(g)) for k, g in itertools.groupby(picks) if k == "v2") == 1
    assert {table.choose("chat", "acme")[0].id for _ in range(20)} == {"v1"}
    before, after = table.update("chat", canary_share=0.0)
    assert before["canary_share"] == 0.25 and after["canary_share"] == 0.0
    assert {table.choose("chat", "other")[0].id for _ in range(20)} == {"v1"}
    with pytest.raises(ValueError, match="not a release of 'chat'"):
        table.update("chat", stable="v9")


def test_health_verdicts() -> None:
    now = [0.0]
    health = ReleaseHealth(clock=lambda: now[0])
    limits = HealthThresholds(window_s=10, min_requests=4, max_error_rate=0.25,
                              max_ttft_p95_s=1.0, min_shadow_agreement=0.5,
                              min_shadow_samples=2)
    for failed in (False, False, False):
        health.record("c", failed, ttft_s=0.1)
    assert health.verdict("c", limits) is None            # too few samples
    health.record("c", True, ttft_s=0.1)
    assert health.verdict("c", limits) is None            # 1/4 is not above 0.25
    health.record("c", True)
    assert health.verdict("c", limits) == "error_rate"
    now[0] = 20.0                                          # the window slides past them
    for _ in range(4):
        health.record("c", False, ttft_s=2.0)
    assert health.verdict("c", limits) == "ttft_p95"
    health.reset("c")
    health.record_agreement("c", 0.1)
    health.record_agreement("c", 0.2)
    assert health.verdict("c", limits) == "shadow_agreement"
    assert is_release_failure(503, None) and is_release_failure(400, "context_length_exceeded")
    assert not is_release_failure(429, "rate_limit_exceeded") and not is_release_failure(None, None)


def test_split_survives_restart_until_config_changes(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["database"] = str(tmp_path / "db.sqlite")
    config = GatewayConfig.from_dict(data)
    routing = ReleaseRouting(config, engines())
    row = routing.change("admin:abc", "chat", "rollback", "bad latency", canary_share=0.0)
    assert row is not None and row["before"]["canary_share"] == 0.25
    routing.close()
    again = ReleaseRouting(config, engines())
    assert again.table.models["chat"].canary_share == 0.0      # the rollback holds
    assert again.store.audit_log("chat")[-1]["actor"] == "admin:abc"
    again.close()
    data["releases"]["chat"]["canary"]["share"] = 0.5          # the operator edits the config
    edited = ReleaseRouting(GatewayConfig.from_dict(data), engines())
    assert edited.table.models["chat"].canary_share == 0.5
    edited.close()


def test_sampling_defaults_fill_only_omitted_fields() -> None:
    req = ChatCompletionRequest.model_validate(
        {"model": "chat", "messages": [{"role": "user", "content": "x"}], "temperature": 1.0})
    filled = apply_sampling_defaults(req, {"temperature": 0.2, "top_p": 0.9, "max_tokens": 7})
    assert filled == ["top_p", "max_tokens"] and req.temperature == 1.0 and req.top_p == 0.9
    assert req.requested_max_tokens == (7, "max_tokens")
    req = ChatCompletionRequest.model_validate(
        {"model": "chat", "messages": [{"role": "user", "content": "x"}],
         "max_completion_tokens": 3})
    assert apply_sampling_defaults(req, {"max_tokens": 7}) == []
    with pytest.raises(ValueError, match="unknown sampling default"):
        apply_sampling_defaults(req, {"beam": 1})


def test_older_ledger_gains_release_columns(tmp_path: Path) -> None:
    import sqlite3

    from llmserve.gateway.billing.ledger import BillingLedger, UsageRecord

    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:   # a ledger written before releases existed
        conn.execute("CREATE TABLE usage (record_id INTEGER PRIMARY KEY AUTOINCREMENT, "
                     "tenant TEXT NOT NULL, request_id TEXT NOT NULL UNIQUE, idempotency_key "
                     "TEXT, model TEXT NOT NULL, served_model TEXT NOT NULL, fingerprint TEXT "
                     "NOT NULL, prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT "
                     "NULL, completion_tokens INTEGER NOT NULL, finish_reason TEXT NOT NULL, "
                     "status INTEGER NOT NULL, created_at REAL NOT NULL, finished_at REAL "
                     "NOT NULL)")
        conn.execute("INSERT INTO usage (tenant, request_id, model, served_model, fingerprint, "
                     "prompt_tokens, cached_tokens, completion_tokens, finish_reason, status, "
                     "created_at, finished_at) VALUES ('a', 'r0', 'm', 'm', '', 1, 0, 1, "
                     "'stop', 200, 1, 2)")
    ledger = BillingLedger(db)
    ledger.record(UsageRecord(tenant="a", request_id="r1", model="chat", fingerprint="f",
                              prompt_tokens=2, cached_tokens=0, completion_tokens=1,
                              finish_reason="stop", status=200, created_at=1, finished_at=2,
                              served_model="m", release_id="v2", release_fingerprint="ab" * 32))
    assert [r.release_id for r in ledger.records()] == [None, "v2"]
    assert [r.request_id for r in ledger.records(release="v2")] == ["r1"]
    ledger.close()


def test_docs_example_config_is_valid() -> None:
    import re

    import yaml

    text = (Path(__file__).resolve().parents[3] / "docs" / "RELEASES.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]
    keys = iter(hash_api_key(f"sk-{i}") for i in range(10))
    example = re.sub(r'"sha256:\.\.\."', lambda _m: f'"{next(keys)}"', example)
    config = GatewayConfig.from_dict(yaml.safe_load(example))
    chat = config.releases["chat"]
    assert chat.canary == "chat-v2" and chat.pins == {"bank": "chat-v1"}
    assert chat.gates.min_structured_validity == 0.95 and chat.health.max_error_rate == 0.05
