"""Prefix cache bookkeeping: chained hashes, namespaces, LRU eviction, accounting (no model)."""
from __future__ import annotations

from llmserve.engine.kv.block_hash import hash_block_tokens, namespace_hash
from llmserve.engine.kv.kv_cache_manager import KVCacheManager
from llmserve.engine.request import Request
from llmserve.sampling_params import SamplingParams
from tests.engine.conftest import BLOCK, make_core
from tests.engine.test_scheduler import run_to_end


def req(rid, tokens, salt=None, max_tokens=2):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                               temperature=0), cache_salt=salt, max_model_len=4096)


PREFIX = list(range(100, 100 + 4 * BLOCK))  # 4 full blocks


def cached_tokens_of_second(first, second, **core_kw):
    core = make_core(**core_kw)
    core.add_request(first)
    run_to_end(core)
    core.add_request(second)
    core.step()
    return second.num_cached_tokens, core


def test_hit_on_shared_prefix_and_last_token_recomputed():
    n, core = cached_tokens_of_second(req("a", PREFIX + [1, 2]), req("b", PREFIX + [3, 4, 5]))
    assert n == len(PREFIX)
    # a prompt that is exactly the cached blocks recomputes its whole last block
    n2, _ = cached_tokens_of_second(req("a", PREFIX + [1]), req("b", list(PREFIX)))
    assert n2 == len(PREFIX) - BLOCK
    stats = core.stats()
    assert stats.prefix_hit_tokens == len(PREFIX)
    assert stats.prefix_query_tokens == len(PREFIX) + 2 + len(PREFIX) + 3


def test_partial_block_prefix_is_not_shared():
    n, _ = cached_tokens_of_second(req("a", PREFIX[:6] + [1]), req("b", PREFIX[:6] + [2, 3]))
    assert n == BLOCK  # only the one full block; the partial second block is recomputed


def test_no_hit_across_tenants():
    n, core = cached_tokens_of_second(req("a", PREFIX + [1], salt="tenant:a"),
                                      req("b", PREFIX + [1], salt="tenant:b"))
    assert n == 0
    n, core = cached_tokens_of_second(req("a", PREFIX + [1], salt="tenant:a"),
                                      req("b", PREFIX + [1], salt="tenant:a"))
    assert n == len(PREFIX)
    assert core.stats().prefix_hit_tokens_by_tenant == {"tenant:a": len(PREFIX)}


def test_no_hit_when_first_token_differs():
    other = [999] + PREFIX[1:]
    n, _ = cached_tokens_of_second(req("a", PREFIX + [1]), req("b", other + [1]))
    assert n == 0


def test_same_text_tokenized_differently_does_not_hit():
    # "hello" as one token vs as five: the ids differ, so the chain differs from block 0
    n, _ = cached_tokens_of_second(req("a", [7000] + PREFIX), req("b", [104, 101, 108, 108, 111]
                                                                + PREFIX))
    assert n == 0


def test_namespace_changes_every_hash():
    toks = PREFIX[:BLOCK]
    roots = {namespace_hash(fp, salt) for fp in ("model-v1", "model-v2") for salt in (None, "t")}
    assert len(roots) == 4
    assert len({hash_block_tokens(r, toks) for r in roots}) == 4
    # the same pool keyed by another fingerprint finds nothing
    kv_a = KVCacheManager(16, BLOCK, True, "model-v1")
    a = req("a", PREFIX + [1])
    assert kv_a.allocate_slots(a, a.num_tokens)
    kv_a.free(a)
    b = req("b", PREFIX + [1])
    assert len(kv_a.find_cached_prefix(b)) == 4
    kv_a.fingerprint, kv_a._roots = "model-v2", {}
    c = req("c", PREFIX + [1])
    assert kv_a.find_cached_prefix(c) == []


def test_preemption_recompute_not_counted_as_hit():
    core = make_core(num_blocks=9, caching=True, max_num_seqs=8)
    core.scheduler.admission_watermark_blocks = 0
    rs = [req(f"r{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 7)), max_tokens=12)
          for i in range(3)]
    for r in rs:
        core.add_request(r)
    run_to_end(core)
    assert core.scheduler.num_preemptions > 0
    assert core.stats().prefix_hit_tokens == 0
    assert all(r.num_cached_tokens == 0 for r in rs)


def test_lru_eviction_order_and_invariants():
    core = make_core(num_blocks=8, max_num_seqs=1)
    core.scheduler.admission_watermark_blocks = 0
    kv = core.kv
    old = req("old", list(range(10, 18)) + [1], max_tokens=1)      # 2 full blocks + 1 token
    new = req("new", list(range(50, 58)) + [1], max_tokens=1)
    for r in (old, new):
        core.add_request(r)
        run_to_end(core)
    kv.check_invariants()
    assert kv.num_used_blocks == 0 and len(kv.pool.cached) == 4
    # a fresh 5-block request must evict; the LRU blocks ("old") go first, "new" survives
    big = req("big", list(range(300, 300 + 4 * BLOCK + 1)), max_tokens=1)
    core.add_request(big)
    core.step()
    kv.check_invariants()
    hit_new = kv.find_cached_prefix(req("probe-new", list(range(50, 58)) + [2]))
    hit_old = kv.find_cached_prefix(req("probe-old", list(range(10, 18)) + [2]))
    assert len(hit_new) == 2 and hit_old == []
    run_to_end(core)
    kv.check_invariants()


def test_hit_moves_block_out_of_free_queue_and_reset_drops_cache():
    core = make_core(num_blocks=32)
    run = req("a", PREFIX + [1])
    core.add_request(run)
    run_to_end(core)
    free_before = core.kv.num_free_blocks
    b = req("b", PREFIX + [2], max_tokens=20)
    core.add_request(b)
    core.step()
    assert b.num_cached_tokens == len(PREFIX)
    assert core.kv.num_free_blocks == free_before - 5  # 4 hit blocks + 1 new one
    core.kv.check_invariants()
    dropped = core.kv.reset_prefix_cache()
    assert dropped >= 4 and not core.kv.pool.cached
    assert core.kv.blocks_of("b")  # blocks in use untouched
    core.kv.check_invariants()
    c = req("c", PREFIX + [3])
    core.add_request(c)
    core.step()
    assert c.num_cached_tokens == 0


def test_reset_one_namespace_only():
    core = make_core(num_blocks=32)
    for rid, salt in (("a", "t1"), ("b", "t2")):
        core.add_request(req(rid, PREFIX + [1], salt=salt))
    run_to_end(core)
    core.kv.reset_prefix_cache("t1", all_namespaces=False)
    assert len(core.kv.find_cached_prefix(req("x", PREFIX + [2], salt="t1"))) == 0
    assert len(core.kv.find_cached_prefix(req("y", PREFIX + [2], salt="t2"))) == 4
