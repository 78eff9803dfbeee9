"""Pinned prefixes, namespace flushes, the chain-namespace check and the hit audit (no model)."""
from __future__ import annotations

import json
import logging

import pytest

from llmserve.engine.kv.kv_cache_manager import KVLedgerError
from tests.engine.conftest import BLOCK, make_core
from tests.engine.kv.test_prefix_cache import PREFIX, req
from tests.engine.test_scheduler import run_to_end


def prefill(core, rid, tokens, salt):
    core.add_request(req(rid, tokens, salt=salt, max_tokens=1))
    run_to_end(core)


def test_pinned_blocks_survive_a_burst_and_count_as_owners():
    core = make_core(num_blocks=12)
    kv = core.kv
    prefill(core, "bundle", PREFIX + [1], "tenant:a")
    assert kv.pins.pin("p1", PREFIX + [1], kv.root("tenant:a")) == 4
    kv.check_invariants()
    assert kv.num_used_blocks == 4 and kv.pins.num_pinned_blocks == 4
    for i in range(6):  # fill the remaining 8 blocks over and over: evicts every unpinned block
        prefill(core, f"burst{i}", [500 + 10 * i + j for j in range(7 * BLOCK)], "tenant:a")
    kv.check_invariants()
    second = req("use", PREFIX + [9, 9], salt="tenant:a")
    assert len(kv.find_cached_prefix(second)) == 4
    assert kv.pins.unpin("p1") == 4 and kv.num_used_blocks == 0
    kv.check_invariants()


def test_pin_takes_only_the_cached_chain_and_respects_max_blocks():
    core = make_core()
    kv = core.kv
    prefill(core, "x", PREFIX[:2 * BLOCK] + [1], "t")
    assert kv.pins.pin("p", PREFIX, kv.root("t")) == 2          # blocks 3 and 4 never cached
    assert kv.pins.pin("p", PREFIX, kv.root("t"), max_blocks=1) == 1  # re-pin replaces
    assert kv.pins.pin("q", PREFIX, kv.root("other")) == 0        # another namespace: nothing
    assert kv.pool.pin_refs == {kv.pins.blocks_of("p")[0]: 1}
    kv.check_invariants()


def test_a_lost_pin_reference_is_a_ledger_error():
    core = make_core()
    kv = core.kv
    prefill(core, "x", PREFIX + [1], "t")
    kv.pins.pin("p", PREFIX, kv.root("t"))
    kv.pool.pin_refs.clear()
    with pytest.raises(KVLedgerError, match="pin"):
        kv.check_invariants()


def test_flush_by_namespace_keeps_other_tenants_and_pins():
    core = make_core()
    kv = core.kv
    prefill(core, "a", PREFIX + [1], "tenant:a")
    prefill(core, "ab", [7] * (2 * BLOCK) + [1], "tenant:a|bundle:x@1")
    prefill(core, "b", PREFIX + [1], "tenant:b")
    pinned = kv.pins.pin("pin", [7] * (2 * BLOCK), kv.root("tenant:a|bundle:x@1"))
    assert pinned == 2
    dropped = kv.reset_prefix_cache("tenant:a", all_namespaces=False, with_children=True,
                                    keep_pinned=True)
    assert dropped == 4
    assert len(kv.find_cached_prefix(req("a2", PREFIX + [1], salt="tenant:a"))) == 0
    assert len(kv.find_cached_prefix(req("b2", PREFIX + [1], salt="tenant:b"))) == 4
    assert len(kv.find_cached_prefix(req("p2", [7] * (2 * BLOCK) + [1],
                                         salt="tenant:a|bundle:x@1"))) == 2
    kv.check_invariants()


def test_idle_check_catches_a_block_whose_namespace_differs_from_its_chain():
    core = make_core()
    kv = core.kv
    prefill(core, "a", PREFIX + [1], "tenant:a")
    kv.check_invariants()
    block = kv.pool.cached[next(iter(kv.pool.cached))]
    block.namespace = "tenant:b"   # what a bug mixing salts would leave behind
    with pytest.raises(KVLedgerError, match="namespace"):
        kv.check_invariants()


def test_hit_audit_logs_a_sample_without_token_content(caplog):
    core = make_core()
    kv = core.kv
    kv.hit_audit.set_sample_rate(1.0)
    prefill(core, "a", PREFIX + [1], "tenant:a")
    with caplog.at_level(logging.INFO, logger="llmserve.cache_audit"):
        prefill(core, "b", PREFIX + [2], "tenant:a")
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "llmserve.cache_audit"]
    assert lines == [{"event": "prefix_cache_hit", "request_id": "b", "namespace": "tenant:a",
                      "block_namespaces": ["tenant:a"], "blocks": 4, "wrong_namespace": False}]
    kv.hit_audit.set_sample_rate(0.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llmserve.cache_audit"):
        prefill(core, "c", PREFIX + [3], "tenant:a")
    assert not [r for r in caplog.records if r.name == "llmserve.cache_audit"]
    assert kv.hit_audit.hits == 2 and kv.hit_audit.logged == 1
    with pytest.raises(ValueError):
        kv.hit_audit.set_sample_rate(1.5)
