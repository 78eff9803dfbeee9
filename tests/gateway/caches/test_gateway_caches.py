"""End to end: the response cache, prompt bundles, multi-turn reuse and the cache admin
endpoints in a real `llmserve serve --config` process (the default model, a 64-block
KV pool of 16-token blocks, max_model_len 512: pins may hold up to 32 blocks).

Tenants: alpha (response cache on, a bundle budget of 32 blocks), beta (response
cache on, a budget of 2 blocks), gamma (no response cache); one admin key.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

import httpx
import openai
import pytest

from llmserve.gateway import hash_api_key
from tests.gateway.gateway_server_helpers import ServerProcess, auth, ledger_rows, write_config
from tests.server.server_helpers import assert_openai_error, parse_sse

pytestmark = pytest.mark.slow

KEYS = {name: f"sk-{name}-" + uuid.uuid4().hex for name in ("alpha", "beta", "gamma")}
ADMIN = "sk-admin-" + uuid.uuid4().hex
CHAT = "/v1/chat/completions"
BLOCK = 16
SYSTEM = ("You are the support assistant of the Acme Rocket Company. Answer questions about "
          "rocket boots, anvils, giant magnets and portable holes. Be brief and polite, never "
          "recommend a competitor, and always remind the customer that the warranty does not "
          "cover falls from cliffs, explosions, or coyotes. ") * 2


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("caches")
    config = write_config(
        folder, {
            "alpha": {"response_cache": True, "bundle_pinned_blocks": 32},
            "beta": {"response_cache": True, "bundle_pinned_blocks": 2},
            "gamma": {},
        }, KEYS,
        database="gateway.db", admin={"keys": [hash_api_key(ADMIN)]},
        response_cache={"max_entries": 100, "max_bytes": 1 << 20, "ttl_s": 600, "store": "sqlite"},
        cache_audit={"sample_rate": 1.0}, metrics={"per_tenant": True},
    )
    server = ServerProcess(config, ["--served-model-name", "default", "--num-kv-blocks", "64", "--max-model-len", "512",
                                    "--max-num-seqs", "4", "--num-threads", "2"],
                           folder / "server.log")
    server.db = folder / "gateway.db"  # type: ignore[attr-defined]
    server.start()
    try:
        yield server
    finally:
        server.stop()


def client(gw: ServerProcess, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url("/v1"), api_key=KEYS[tenant], max_retries=0)


def post(gw: ServerProcess, key: str, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(gw.url(path), json=body, headers=auth(key, **headers), timeout=120)


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": "default", "messages": [{"role": "user", "content": content}],
            "max_tokens": 6, "temperature": 0, **kw}


def cached_tokens(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


# ---------------------------------------------------------------------- response cache

def test_identical_deterministic_requests_hit_byte_identical_and_billed_as_hits(gw) -> None:
    messages = [{"role": "user", "content": f"[{uuid.uuid4().hex}] Name three colors."}]
    c = client(gw, "alpha")
    first = c.chat.completions.with_raw_response.create(model="default", messages=messages,
                                                        max_tokens=8, temperature=0)
    assert first.headers["x-cache"] == "miss"
    generated = gw.metric("llmserve_generation_tokens")
    second = c.chat.completions.with_raw_response.create(model="default", messages=messages,
                                                         max_tokens=8, temperature=0, user="x")
    assert second.headers["x-cache"] == "hit"
    assert second.http_response.content == first.http_response.content
    assert second.headers["x-request-id"] != first.headers["x-request-id"]
    assert "idempotent-replayed" not in second.headers
    assert gw.metric("llmserve_generation_tokens") == generated  # no engine work
    [row] = ledger_rows(gw.db, request_id=second.headers["x-request-id"])
    done = first.parse()
    assert row["cache_hit"] == 1 and row["status"] == 200
    assert row["completion_tokens"] == done.usage.completion_tokens
    assert row["prompt_tokens"] == row["cached_tokens"] == done.usage.prompt_tokens
    [orig] = ledger_rows(gw.db, request_id=first.headers["x-request-id"])
    assert orig["cache_hit"] == 0
    assert gw.metric("llmserve_response_cache_requests_total", tenant="alpha", result="hit") >= 1


def test_streamed_hit_replays_the_same_events(gw) -> None:
    body = chat(f"[{uuid.uuid4().hex}] Count to five.", stream=True,
                stream_options={"include_usage": True})
    first = post(gw, KEYS["alpha"], CHAT, body)
    second = post(gw, KEYS["alpha"], CHAT, body)
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("miss", "hit")
    assert second.content == first.content
    events = parse_sse(second.text)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] > 0
    # the plain (non-streamed) form of the same request is another entry
    assert post(gw, KEYS["alpha"], CHAT, chat(body["messages"][0]["content"])) \
        .headers["x-cache"] == "miss"


def test_sampled_opted_out_and_other_tenants_never_hit(gw) -> None:
    text = f"[{uuid.uuid4().hex}] Say hello."
    sampled = chat(text, temperature=0.8)
    for _ in range(2):
        r = post(gw, KEYS["alpha"], CHAT, sampled)
        assert r.status_code == 200 and "x-cache" not in r.headers
    for body, headers in ((chat(text, cache=False), {}),
                          (chat(text), {"Cache-Control": "no-store"})):
        r = post(gw, KEYS["alpha"], CHAT, body, **headers)
        assert r.status_code == 200 and "x-cache" not in r.headers
    seeded = chat(text, temperature=0.8, seed=7, n=2)
    assert post(gw, KEYS["alpha"], CHAT, seeded).headers["x-cache"] == "miss"
    assert post(gw, KEYS["alpha"], CHAT, seeded).headers["x-cache"] == "hit"
    assert post(gw, KEYS["beta"], CHAT, seeded).headers["x-cache"] == "miss"   # other tenant
    r = post(gw, KEYS["gamma"], CHAT, seeded)                                  # not opted in
    assert r.status_code == 200 and "x-cache" not in r.headers


def test_a_hit_with_an_idempotency_key_is_kept_for_its_retries(gw) -> None:
    body = chat(f"[{uuid.uuid4().hex}] Name a fruit.")
    assert post(gw, KEYS["alpha"], CHAT, body).headers["x-cache"] == "miss"
    key = uuid.uuid4().hex
    hit = post(gw, KEYS["alpha"], CHAT, body, **{"Idempotency-Key": key})
    retry = post(gw, KEYS["alpha"], CHAT, body, **{"Idempotency-Key": key})
    assert hit.headers["x-cache"] == "hit" and retry.headers["idempotent-replayed"] == "true"
    assert retry.content == hit.content
    rows = [r for r in ledger_rows(gw.db, tenant="alpha") if r["idempotency_key"] == key]
    assert len(rows) == 1 and rows[0]["cache_hit"] == 1   # billed once, as a hit


# ---------------------------------------------------------------------- prompt bundles

def bundle_chat(ref: str, content: str) -> dict[str, Any]:
    return {"model": "default", "prompt_bundle": ref, "max_tokens": 2, "temperature": 0.5,
            "messages": [{"role": "user", "content": content}]}


def test_bundle_is_pinned_survives_a_burst_and_versions_do_not_share_kv(gw) -> None:
    system = [{"role": "system", "content": SYSTEM}]
    r = post(gw, KEYS["alpha"], "/v1/prompt_bundles", {"name": "support", "messages": system})
    assert r.status_code == 200, r.text
    v1 = r.json()
    assert (v1["name"], v1["version"], v1["shared"]) == ("support", 1, False)
    assert v1["pinned_blocks"] == v1["prefix_tokens"] // BLOCK >= 4
    assert v1["cached_tokens"] == v1["pinned_blocks"] * BLOCK
    first = post(gw, KEYS["alpha"], CHAT, bundle_chat("support", "Do you sell anvils?"))
    assert cached_tokens(first) >= v1["cached_tokens"]
    assert first.json()["usage"]["prompt_tokens"] > v1["prefix_tokens"]
    # a burst of long prompts from another tenant evicts every unpinned block
    probe = {"model": "default", "prompt": f"[{uuid.uuid4().hex}] " + "red green blue " * 60,
             "max_tokens": 1, "temperature": 0}
    assert cached_tokens(post(gw, KEYS["gamma"], "/v1/completions", probe)) == 0
    for i in range(3):
        burst = {"model": "default", "prompt": f"[{i}{uuid.uuid4().hex}] " + "one two " * 170,
                 "max_tokens": 1}
        assert post(gw, KEYS["gamma"], "/v1/completions", burst).status_code == 200
    assert cached_tokens(post(gw, KEYS["gamma"], "/v1/completions", probe)) == 0  # evicted
    again = post(gw, KEYS["alpha"], CHAT, bundle_chat("support@1", "And magnets?"))
    assert cached_tokens(again) >= v1["cached_tokens"]
    # version 2 with the very same messages: prefilled in its own namespace, no hit on v1
    v2 = post(gw, KEYS["alpha"], "/v1/prompt_bundles",
              {"name": "support", "messages": system}).json()
    assert v2["version"] == 2
    stats = httpx.get(gw.url("/admin/cache/stats"), headers=auth(ADMIN), timeout=30).json()
    engine = next(iter(stats["engines"].values()))
    ns_v2 = "tenant:alpha|bundle:tenant:alpha/support@2"
    assert engine["prefix_tokens_by_namespace"][ns_v2]["hit"] == 0
    assert engine["prefix_tokens_by_namespace"][ns_v2]["queried"] >= v2["prefix_tokens"]
    assert engine["blocks_pinned"] == v1["pinned_blocks"] + v2["pinned_blocks"]
    bundles = {b["bundle"]: b for b in stats["bundles"]}
    assert bundles["tenant:alpha/support@1"]["requests"] == 2
    assert bundles["tenant:alpha/support@1"]["hit_rate"] == 1.0
    assert stats["tenants"]["alpha"]["pinned_blocks"] == engine["blocks_pinned"]
    # delete unpins
    gone = httpx.delete(gw.url("/v1/prompt_bundles/support"), headers=auth(KEYS["alpha"]),
                        timeout=30)
    assert gone.status_code == 200 and gone.json()["versions"] == [1, 2]
    assert gw.metric("llmserve_prompt_bundle_pinned_blocks", tenant="alpha") == 0
    stats = httpx.get(gw.url("/admin/cache/stats"), headers=auth(ADMIN), timeout=30).json()
    assert next(iter(stats["engines"].values()))["blocks_pinned"] == 0
    assert_openai_error(post(gw, KEYS["alpha"], CHAT, bundle_chat("support", "hi")), 404,
                        code="prompt_bundle_not_found")


def test_bundle_budget_is_enforced_and_shared_bundles(gw) -> None:
    r = post(gw, KEYS["beta"], "/v1/prompt_bundles",
             {"name": "faq", "messages": [{"role": "system", "content": SYSTEM}]})
    assert r.status_code == 200 and r.json()["pinned_blocks"] == 2 < r.json()["prefix_tokens"] // BLOCK
    assert gw.metric("llmserve_prompt_bundle_pinned_blocks", tenant="beta") == 2
    assert gw.metric("llmserve_prompt_bundle_pin_budget_blocks", tenant="beta") == 2
    assert post(gw, KEYS["gamma"], CHAT, bundle_chat("faq", "hi")).status_code == 404  # beta's
    shared = post(gw, ADMIN, "/v1/prompt_bundles",
                  {"name": "house", "messages": [{"role": "system", "content": "Be terse."}]})
    assert shared.status_code == 200 and shared.json()["shared"] is True
    listed = httpx.get(gw.url("/v1/prompt_bundles"), headers=auth(KEYS["gamma"]), timeout=30)
    assert [b["name"] for b in listed.json()["data"]] == ["house"]
    assert post(gw, KEYS["gamma"], CHAT, bundle_chat("house", "hi")).status_code == 200
    tools = post(gw, KEYS["gamma"], "/v1/prompt_bundles",
                 {"name": "tooly", "messages": [{"role": "system", "content": "x"}],
                  "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                      "type": "object", "properties": {}, "additionalProperties": False}}}]})
    assert tools.status_code == 200
    # the bundle's tools join the request's: the pinned prefix was templated with them
    used = post(gw, KEYS["gamma"], CHAT, {**bundle_chat("tooly", "hi"), "max_tokens": 60,
                                          "tool_choice": {"type": "function",
                                                          "function": {"name": "f"}}})
    assert used.status_code == 200, used.text
    assert used.json()["choices"][0]["message"].get("tool_calls", [{}])[0].get("function", {}).get("name") == "f", used.text
    assert used.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
        tools.json()["pinned_blocks"] * BLOCK > 0
    twice = {**bundle_chat("tooly", "hi"),
             "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert_openai_error(post(gw, KEYS["gamma"], CHAT, twice), 400)
    assert_openai_error(post(gw, KEYS["gamma"], "/v1/prompt_bundles", {"name": "x"}), 400)


# ---------------------------------------------------------------------- multi-turn

def test_turn_two_hits_turn_one_prompt_and_answer(gw) -> None:
    c = client(gw, "gamma")
    messages = [{"role": "system", "content": f"Session {uuid.uuid4().hex}. You tell stories."},
                {"role": "user", "content": "Tell me a long story about a brave cat."}]
    one = c.chat.completions.create(model="default", messages=messages, max_tokens=40,
                                    temperature=0)
    p1, c1 = one.usage.prompt_tokens, one.usage.completion_tokens
    assert c1 >= BLOCK  # the answer fills at least one block of its own
    messages += [{"role": "assistant", "content": one.choices[0].message.content},
                 {"role": "user", "content": "Now make it shorter."}]
    two = c.chat.completions.create(model="default", messages=messages, max_tokens=2,
                                    temperature=0)
    cached = two.usage.prompt_tokens_details.cached_tokens
    # every full block of turn 1's prompt + answer (its last token's KV is never computed)
    assert cached >= (p1 + c1 - 1) // BLOCK * BLOCK >= p1, (p1, c1, cached)


# ---------------------------------------------------------------------- admin operations

def test_flush_empties_one_tenants_prefix_cache_only(gw) -> None:
    prompt = {"model": "default", "prompt": f"[{uuid.uuid4().hex}] " + "apple pear plum " * 20,
              "max_tokens": 1, "temperature": 0.5}
    for tenant in ("alpha", "gamma"):
        assert cached_tokens(post(gw, KEYS[tenant], "/v1/completions", prompt)) == 0
        assert cached_tokens(post(gw, KEYS[tenant], "/v1/completions", prompt)) > 0
    assert_openai_error(post(gw, KEYS["alpha"], "/admin/prefix_cache/flush", {"tenant": "alpha"}),
                        403, code="admin_key_required")
    assert_openai_error(httpx.post(gw.url("/admin/prefix_cache/flush"), json={}, timeout=30), 401)
    assert_openai_error(post(gw, ADMIN, "/admin/prefix_cache/flush", {}), 400)
    r = post(gw, ADMIN, "/admin/prefix_cache/flush", {"tenant": "alpha"})
    assert r.status_code == 200 and sum(r.json()["blocks_dropped"].values()) > 0
    assert cached_tokens(post(gw, KEYS["alpha"], "/v1/completions", prompt)) == 0
    assert cached_tokens(post(gw, KEYS["gamma"], "/v1/completions", prompt)) > 0


def test_hit_audit_log_names_namespace_and_request_never_content(gw) -> None:
    lines = [json.loads(line.split(" llmserve.cache_audit: ", 1)[1])
             for line in gw.log_text().splitlines() if " llmserve.cache_audit: " in line]
    assert lines, "no sampled prefix-hit audit lines"
    assert all(set(x) == {"event", "request_id", "namespace", "block_namespaces", "blocks",
                          "wrong_namespace"} for x in lines)
    assert any(x["namespace"] == "tenant:gamma" and x["blocks"] > 0 for x in lines)
    assert not any(x["wrong_namespace"] for x in lines)
    assert "apple pear" not in "\n".join(json.dumps(x) for x in lines)


def test_a_bundle_longer_than_every_context_is_refused(gw) -> None:
    """A bundle that leaves no room for a request in any served model's context (512 here)
    could never be used: 400 bundle_too_long, and nothing is stored. Issue 33."""
    huge = [{"role": "system", "content": "Always answer politely and briefly. " * 200}]
    r = post(gw, KEYS["gamma"], "/v1/prompt_bundles", {"name": "huge", "messages": huge})
    err = assert_openai_error(r, 400, param="messages", code="bundle_too_long")
    assert "cannot fit any served model's context" in err["message"]
    listing = httpx.get(gw.url("/v1/prompt_bundles"), headers=auth(KEYS["gamma"]), timeout=30)
    assert "huge" not in [b["name"] for b in listing.json()["data"]]
