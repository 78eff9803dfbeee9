"""The prompt-bundle registry (versions, persistence, lookup) and the bundle prefix rule."""
from __future__ import annotations

import pytest

from llmserve.gateway.caches.bundle_kv import bundle_prefix_tokens
from llmserve.gateway.caches.prompt_bundles import SHARED, BundleNotFound, BundleRegistry, parse_bundle_body, parse_ref
from llmserve.gateway.errors import InvalidRequest
from tests.server.server_fakes import FakeTokenizer

SYS = [{"role": "system", "content": "Be kind."}]


def test_versions_are_never_reused_and_survive_a_restart(tmp_path):
    db = str(tmp_path / "g.db")
    reg = BundleRegistry(db, max_versions=2)
    assert reg.create("tenant:a", "s", SYS, None)[0].version == 1
    assert reg.create("tenant:a", "s", SYS, None)[0].version == 2
    v3, dropped = reg.create("tenant:a", "s", SYS, None)
    assert v3.version == 3 and [b.version for b in dropped] == [1]
    assert [b.version for b in reg.delete("tenant:a", "s")] == [2, 3]
    assert reg.create("tenant:a", "s", SYS, None)[0].version == 4  # never 1 again
    reg.close()
    again = BundleRegistry(db)
    assert again.resolve(["tenant:a"], "s").version == 4
    assert again.create("tenant:a", "s", SYS, None)[0].version == 5
    again.close()


def test_lookup_prefers_the_tenants_own_bundle_then_shared():
    reg = BundleRegistry()
    reg.create(SHARED, "s", SYS, None)
    mine, _ = reg.create("tenant:a", "s", [{"role": "system", "content": "mine"}], None)
    assert reg.resolve(["tenant:a", SHARED], "s") == mine
    assert reg.resolve(["tenant:b", SHARED], "s").owner == SHARED
    with pytest.raises(BundleNotFound):
        reg.resolve(["tenant:b", SHARED], "s@2")
    assert mine.cache_salt("tenant:a") == "tenant:a|bundle:tenant:a/s@1"


def test_bad_bodies_and_refs_are_400s():
    assert parse_bundle_body(b'{"name": "s", "messages": [{"role": "system", "content": "x"}]}')[0] == "s"
    for raw in (b"[]", b'{"name": "s"}', b'{"name": "s", "messages": []}',
                b'{"name": "bad name", "messages": [{"role": "system", "content": "x"}]}',
                b'{"name": "s", "messages": [{"role": "robot", "content": "x"}]}',
                b'{"name": "s", "messages": [{"role": "system", "content": "x"}], "x": 1}'):
        with pytest.raises(InvalidRequest):
            parse_bundle_body(raw)
    assert parse_ref("s@12") == ("s", 12) and parse_ref("s") == ("s", None)
    for ref in ("s@0", "s@x", "", 5):
        with pytest.raises(InvalidRequest):
            parse_ref(ref)


def test_bundle_prefix_is_what_every_request_starts_with():
    tok = FakeTokenizer()
    prefix = bundle_prefix_tokens(tok, SYS)
    alone = tok.encode(tok.apply_chat_template(SYS, add_generation_prompt=False))
    assert prefix == alone  # ChatML closes the system turn the same way in both
    full = tok.encode(tok.apply_chat_template(SYS + [{"role": "user", "content": "q"}]))
    assert full[:len(prefix)] == prefix
